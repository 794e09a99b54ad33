"""bench/RESULTS.md sections: each benchmark script owns the lines between its own begin and end
markers, and `--write` replaces them (or appends the section when it is not there yet)."""
import os
import platform

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                    "RESULTS.md")


def write_section(lines, begin, end):
    """Replaces the section from `begin` to `end` with `lines` (which start with `begin` and end
    with `end`)."""
    text = open(PATH).read()
    block = "\n".join(lines) + "\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(PATH, "w") as f:
        f.write(text)
    print(f"wrote {PATH}")


def machine():
    """The CPU model, its core count and the kernel, for a section's header."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}"
