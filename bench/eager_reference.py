#!/usr/bin/python3
"""PyTorch-eager reference of weft's model and training step ("what people use today").

Run with Debian's Python (torch 1.13 + numpy, nothing else):

    build/weft bench step CONFIG --dump DIR        # weft times itself, writes DIR
    /usr/bin/python3 bench/eager_reference.py DIR [--head all|targets] [--device cpu|cuda]
                                                  [--json OUT]

DIR holds what `weft bench step --dump` writes: config.toml (the resolved config),
model.safetensors (every parameter, full shape, fp32, under weft's names), step-NNNNN.safetensors
(each step's microbatches, exactly as weft consumed them) and bench.json (warmup/steps, threads,
precision, per-step lr / target count / real tokens / model FLOPs, weft's own losses and gradient
norms, the MFU denominator). This script builds the same model as an idiomatic nn.Module, loads
the same weights, runs the same warmup + timed steps on the same batches and prints (and with
--json writes) losses, gradient norms, step times, tokens/s, MFU and peak memory as JSON.

--device cuda (torch 2.x with CUDA, e.g. pip torch; the dump of a `train.device = "cuda"` run)
puts the parameters, the optimizer state and every step's batches on the current CUDA device
(batches are moved before the clock starts) and runs the same step there; see Timing and
Attention below for what differs from the CPU path. The default, --device cpu, is the path
bench/RESULTS.md reports, unchanged.

It computes the same function as weft (src/weft/model/*.cpp, src/weft/train/optimizer.cpp):
  * LLM (llm.cpp): embedding, pre-RMSNorm blocks (RMSNorm in fp32, returned in the input dtype),
    fused QKV [heads*D | kv*D | kv*D] with rotate-half RoPE (optionally Llama-3.1 scaled) and
    grouped-query attention (kv heads repeated), scale 1/sqrt(D), boolean visibility mask,
    softmax in fp32 cast back to V's dtype (torch_compat.h); SwiGLU with fused gate_up (first
    half gate, second half up); final RMSNorm; head tied to the embedding unless `head` exists.
  * Encoders (encoder.cpp): ViT (optional 3x3 stride-2 conv stem + GELU, patch conv, optional
    [CLS], learned positions, optional pre-LN, pre-LN blocks up to feature_layer, [CLS] dropped)
    and Whisper (conv1 + GELU, stride-2 conv2 + GELU, sinusoidal positions, blocks, final LN).
    LayerNorms compute in fp32. Projector: fc1 -> exact GELU -> fc2, or one linear.
  * Multimodal (multimodal.cpp, mask.cpp): projected features replace the embeddings at the
    placeholder rows (index_copy into the flattened [B*S] rows); attention sees
    (same_doc & (causal | same_item)) | self; loss = sum of cross-entropy over the target rows
    (fp32 logits) / the step's global target count, summed over microbatches.
  * Frozen modules (`frozen = true` on [model.llm], [model.<enc>], [model.<enc>.projector]) do
    not require grad and are not in the optimizer.
  * AdamW with weight decay only on parameters of dim >= 2, and global-norm gradient clipping.
  * `recompute = true` on [model.llm] / [model.<enc>] (absent in older dumps = false): each block
    under torch.utils.checkpoint (non-reentrant), the idiomatic activation checkpointing.

Deliberate idiomatic choices (this is the baseline a PyTorch user would write, not a port):
  * bf16 = torch.autocast(DEVICE, dtype=torch.bfloat16) around forward + loss (DEVICE = "cpu"
    or "cuda", the --device), fp32 parameters,
    backward outside autocast. Where autocast alone would leave a tensor in fp32 that weft keeps
    in bf16 (the embedding output, learned positions, [CLS]) it is cast to the autocast dtype, so
    the residual stream is bf16 as in weft. precision = "fp32" runs without autocast.
  * torch.optim.AdamW with two parameter groups (decay / no decay) and
    torch.nn.utils.clip_grad_norm_: the same math as weft's optimizer. (torch keeps a step count
    per parameter, weft one per optimizer: they differ only if a parameter gets no gradient in
    some step, e.g. an encoder with no items in a whole step.)
  * --head all (default) is the Hugging-Face-style loss: logits for every position (B*S x vocab)
    and labels = -100 except at the target rows, F.cross_entropy(ignore_index=-100,
    reduction="sum"). --head targets computes logits only for the target rows, as weft does.
    Both give the same loss.
  * Attention. CPU: plain eager attention (matmul, masked_fill, softmax, matmul) as in HF's
    "eager" attention and weft's LibTorch 1.13 path: torch 1.13 has no
    scaled_dot_product_attention. CUDA with torch >= 2.0: F.scaled_dot_product_attention with
    the boolean visibility mask (HF's "sdpa" attention, the default there on a GPU; with an
    arbitrary mask torch picks the memory-efficient or the math kernel, not flash). K/V heads
    are repeated for grouped-query attention on both paths.

Timing: each step = zero grads (set_to_none), per microbatch forward + (loss_sum / targets)
.backward(), clip, set the step's lr, optimizer.step(); timed with time.perf_counter from the
previous step's finish to this one's. On the CPU the loss .item() is read inside the step. On
CUDA, as an idiomatic loop that logs without stalling the GPU (and as weft on a GPU), the loss
and the norm stay on the GPU: step i + 1 is queued before a CUDA event recorded after step i's
optimizer.step() is waited on, and step i's time ends when that event completes (the GPU's
pace); the timed steps start after the warm-up is done and the GPU idle, as in weft's bench.
Memory: VmRSS right after the imports is the baseline; VmHWM is reset (/proc/self/clear_refs)
once the model and batches are in memory (torch.optim creates its state in the first step) and
read after the last step; step_peak_bytes = VmHWM - baseline. On CUDA
torch.cuda.reset_peak_memory_stats() is called at the same point as the RSS reset (before the
first step, as weft resets its device peak) and step_peak_bytes =
torch.cuda.max_memory_allocated() after the last step: the device memory of the parameters,
batches, gradients, optimizer state and activations (weft reports the same quantity as
device_peak_bytes; the host RSS fields are kept as they are).

Errors (missing or malformed files, unsupported settings) print a message naming the file or
field and exit with status 1.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import tomllib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def read_status_bytes(field):
    """A "kB" field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


BASELINE_RSS = read_status_bytes("VmRSS")  # right after the imports


class DumpError(Exception):
    """A problem with the dump; printed as the error message, exit status 1."""


# ------------------------------------------------------------------------------------------------
# safetensors, read with numpy

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


def load_safetensors(path):
    """{name: tensor} of a safetensors file (BF16 becomes fp32; every tensor owns its memory)."""
    if not os.path.isfile(path):
        raise DumpError(f"{path}: missing")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DumpError(f"{path}: not a safetensors file (shorter than its header)")
        n = int.from_bytes(prefix, "little")
        if n > size - 8:
            raise DumpError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise DumpError(f"{path}: malformed safetensors header: {e}") from None
    data_start = 8 + n
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if size > data_start \
        else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise DumpError(f"{path}: tensor '{name}': malformed header entry") from None
        if dtype not in _DTYPES:
            raise DumpError(f"{path}: tensor '{name}': unsupported dtype {dtype}")
        np_dtype = np.dtype(_DTYPES[dtype])
        count = math.prod(shape)
        if not (0 <= begin <= end <= data.size) or end - begin != count * np_dtype.itemsize:
            raise DumpError(f"{path}: tensor '{name}': data_offsets [{begin}, {end}) do not "
                                 f"hold {dtype} {shape} within the file")
        arr = np.frombuffer(data[begin:end], dtype=np_dtype).reshape(shape).copy()
        if dtype == "BF16":  # bf16 is the high half of an fp32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = torch.from_numpy(arr)
    del data
    return out


# ------------------------------------------------------------------------------------------------
# Model (layers.cpp, llm.cpp, encoder.cpp, multimodal.cpp)

def compute_dtype(device_type="cpu"):
    """The dtype activations are in: autocast's inside an autocast region, else fp32."""
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else torch.float32
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        enabled = torch.is_autocast_enabled(device_type)
        return torch.get_autocast_dtype(device_type) if enabled else torch.float32
    return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else torch.float32


_TORCH_1 = int(torch.__version__.split(".")[0]) < 2
_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # torch >= 2.0


def gelu(x, approximate="none"):
    """F.gelu. torch 1.13's CPU GELU backward is wrong for a non-contiguous incoming gradient
    (zeros / NaN; Whisper's front end transposes right after it): hand it a contiguous one, as
    weft's compat::gelu does."""
    y = F.gelu(x, approximate=approximate)
    if y.requires_grad and _TORCH_1:
        y.register_hook(lambda g: None if g.is_contiguous() else g.contiguous())
    return y


def activate(x, act):
    if act == "quick_gelu":
        return x * torch.sigmoid(x * 1.702)
    if act == "gelu_tanh":
        return gelu(x, "tanh")
    return gelu(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # fp32, back in x's dtype
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    def forward(self, x):  # fp32, back in x's dtype
        return super().forward(x.float()).to(x.dtype)


def rope_tables(positions, head_dim, theta, scaling):
    """cos, sin [B, S, 1, D] (rotate-half), optionally with Llama-3.1 frequency scaling."""
    half = head_dim // 2
    inv_freq = torch.pow(theta, torch.arange(0, half, dtype=torch.float64,
                                             device=positions.device) * (-2.0 / head_dim))
    if scaling is not None:  # transformers' _compute_llama3_parameters
        factor, low, high, old_len = scaling
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    angle = positions.double().unsqueeze(-1) * inv_freq
    angle = torch.cat([angle, angle], -1).unsqueeze(2)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, qkv_bias, out_bias):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=qkv_bias)
        self.out = nn.Linear(heads * self.head_dim, hidden, bias=out_bias)

    def forward(self, x, visible=None, rope=None):
        B, S, _ = x.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, S, H + 2 * KV, D).split([H, KV, KV], dim=2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        if KV != H:  # grouped-query: K/V head j serves query heads j*rep .. j*rep+rep-1
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
        if _HAS_SDPA and q.is_cuda:  # torch 2.x on a GPU; a True in `visible` = may attend
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            return self.out(o.transpose(1, 2).reshape(B, S, H * D))
        scores = torch.matmul(q, k.transpose(-2, -1)).float() * (1.0 / math.sqrt(D))
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype)
        return self.out(torch.matmul(probs, v).transpose(1, 2).reshape(B, S, H * D))


class SwiGlu(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class GeluMlp(nn.Module):
    def __init__(self, dim_in, ffn, dim_out, act="gelu"):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim_in, ffn), nn.Linear(ffn, dim_out), act

    def forward(self, x):
        return self.fc2(activate(self.fc1(x), self.act))


class EncoderBlock(nn.Module):  # pre-LN, bidirectional
    def __init__(self, c):
        super().__init__()
        self.ln1 = LayerNorm(c["hidden"], eps=c["norm_eps"])
        self.attn = Attention(c["hidden"], c["heads"], c["heads"], True, True)
        self.ln2 = LayerNorm(c["hidden"], eps=c["norm_eps"])
        self.mlp = GeluMlp(c["hidden"], c["ffn"], c["hidden"], c["act"])

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def layers_used(c):
    fl = c["feature_layer"]
    return c["layers"] + 1 + fl if fl < 0 else fl


def run_block(block, recompute, x, *args):
    """block(x, *args); with recompute (weft's `recompute = true`) under activation
    checkpointing: only the block's input is kept, the block runs again in backward."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, *args, use_reentrant=False, preserve_rng_state=False)
    return block(x, *args)


class VisionEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        in_ch, kernel = c["channels"], c["patch"]
        self.stem = nn.ModuleList()
        for _ in range(c["stem_layers"] if c["stem_channels"] > 0 else 0):
            self.stem.append(nn.Conv2d(in_ch, c["stem_channels"], 3, stride=2, padding=1))
            in_ch, kernel = c["stem_channels"], kernel // 2
        self.patch = nn.Conv2d(in_ch, c["hidden"], kernel, stride=kernel, bias=c["patch_bias"])
        self.class_token = nn.Parameter(torch.zeros(c["hidden"])) if c["class_token"] else None
        self.tokens = (c["image_size"] // c["patch"]) ** 2
        self.position = nn.Parameter(torch.zeros(self.tokens + (1 if c["class_token"] else 0),
                                                 c["hidden"]))
        self.pre_ln = LayerNorm(c["hidden"], eps=c["norm_eps"]) if c["pre_norm"] else None
        self.layers = nn.ModuleList(EncoderBlock(c) for _ in range(c["layers"]))

    def forward(self, images):  # [N, C, H, W] -> [N, tokens, hidden]
        x = images
        for conv in self.stem:
            x = gelu(conv(x))
        x = self.patch(x).flatten(2).transpose(1, 2)
        if self.class_token is not None:
            cls = self.class_token.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], 1)
        x = x + self.position.to(x.dtype)
        if self.pre_ln is not None:
            x = self.pre_ln(x)
        for block in self.layers[:layers_used(self.c)]:
            x = run_block(block, self.c["recompute"], x)
        return x[:, 1:] if self.class_token is not None else x


def sinusoids(length, dim):
    half = dim // 2
    step = math.log(10000.0) / max(half - 1, 1)
    inv = torch.exp(torch.arange(half, dtype=torch.float64) * -step)
    t = torch.arange(length, dtype=torch.float64).unsqueeze(1) * inv.unsqueeze(0)
    return torch.cat([t.sin(), t.cos()], 1).float()


class AudioEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.tokens = c["frames"] // 2
        self.conv1 = nn.Conv1d(c["mels"], c["hidden"], 3, padding=1)
        self.conv2 = nn.Conv1d(c["hidden"], c["hidden"], 3, stride=2, padding=1)
        self.register_buffer("position", sinusoids(self.tokens, c["hidden"]), persistent=False)
        self.layers = nn.ModuleList(EncoderBlock(c) for _ in range(c["layers"]))
        self.final_ln = LayerNorm(c["hidden"], eps=c["norm_eps"])

    def forward(self, mels):  # [N, mels, frames] -> [N, frames/2, hidden]
        x = gelu(self.conv1(mels))
        x = gelu(self.conv2(x))
        x = x.transpose(1, 2) + self.position.to(x.dtype)
        for block in self.layers[:layers_used(self.c)]:
            x = run_block(block, self.c["recompute"], x)
        return self.final_ln(x)


class LinearProjector(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)

    def forward(self, x):
        return self.linear(x)


class Encoder(nn.Module):
    """A modality encoder and its projector (weft's "<enc>.*" and "<enc>.projector.*")."""

    def __init__(self, c, llm_hidden):
        super().__init__()
        self.encoder = VisionEncoder(c) if c["kind"] == "vit" else AudioEncoder(c)
        self.tokens = self.encoder.tokens
        if c["projector"]["kind"] == "linear":
            self.projector = LinearProjector(c["hidden"], llm_hidden)
        else:  # LLaVA-1.5: fc1, exact GELU, fc2
            self.projector = GeluMlp(c["hidden"], llm_hidden, llm_hidden)

    def forward(self, inputs):  # [N, ...] -> [N * tokens, llm hidden]
        return self.projector(self.encoder(inputs)).flatten(0, 1)


class LlmBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm1 = RMSNorm(c["hidden"], c["norm_eps"])
        self.attn = Attention(c["hidden"], c["heads"], c["kv_heads"], c["qkv_bias"], False)
        self.norm2 = RMSNorm(c["hidden"], c["norm_eps"])
        self.mlp = SwiGlu(c["hidden"], c["ffn"])

    def forward(self, x, visible, rope):
        x = x + self.attn(self.norm1(x), visible, rope)
        return x + self.mlp(self.norm2(x))


class Llm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embedding = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(LlmBlock(c) for _ in range(c["layers"]))
        self.final_norm = RMSNorm(c["hidden"], c["norm_eps"])
        self.head = None if c["tie_embeddings"] else nn.Linear(c["hidden"], c["vocab"], bias=False)
        self.rope_scaling = None
        if c["rope_scaling"] == "llama3":
            self.rope_scaling = (c["rope_scaling_factor"], c["rope_low_freq_factor"],
                                 c["rope_high_freq_factor"], c["rope_original_max_position"])

    def forward(self, x, positions, visible):  # final-normed hidden states
        rope = rope_tables(positions, self.c["hidden"] // self.c["heads"], self.c["rope_theta"],
                           self.rope_scaling)
        for block in self.layers:
            x = run_block(block, self.c["recompute"], x, visible, rope)
        return self.final_norm(x)

    def logits(self, h):  # fp32
        weight = self.embedding.weight if self.head is None else self.head.weight
        return F.linear(h, weight).float()


def visible_mask(doc, item):
    """bool [B, 1, S, S]: (same_doc & (causal | same_item)) | self (mask.cpp)."""
    S = doc.shape[1]
    pos = torch.arange(S, device=doc.device)
    causal = pos.view(S, 1) >= pos.view(1, S)
    self_ = pos.view(S, 1) == pos.view(1, S)
    dq, dk, iq, ik = doc.unsqueeze(2), doc.unsqueeze(1), item.unsqueeze(2), item.unsqueeze(1)
    same_doc = (dq == dk) & (dq >= 0)
    same_item = (iq == ik) & (iq >= 0)
    return ((same_doc & (causal | same_item)) | self_).unsqueeze(1)


class MultimodalModel(nn.Module):
    def __init__(self, llm_cfg, enc_cfgs):
        super().__init__()
        self.encoders = nn.ModuleDict({name: Encoder(c, llm_cfg["hidden"])
                                       for name, c in enc_cfgs.items()})
        self.llm = Llm(llm_cfg)

    def forward(self, mb, head):
        """Σ cross-entropy over the microbatch's target rows (fp32 scalar)."""
        tokens = mb["tokens"]
        B, S = tokens.shape
        x = self.llm.embedding(tokens).to(compute_dtype(tokens.device.type)).flatten(0, 1)
        for e, encoder in enumerate(self.encoders.values()):
            if e in mb["enc"]:
                inputs, rows = mb["enc"][e]
                x = x.index_copy(0, rows, encoder(inputs).to(x.dtype))
        h = self.llm(x.view(B, S, -1), mb["positions"], visible_mask(mb["doc"], mb["item"]))
        if head == "all":  # Hugging Face style: every position's logits, -100 = ignore
            logits = self.llm.logits(h.flatten(0, 1))
            return F.cross_entropy(logits, mb["labels"], ignore_index=-100, reduction="sum")
        logits = self.llm.logits(h.flatten(0, 1).index_select(0, mb["target_rows"]))
        return F.cross_entropy(logits, mb["targets"], reduction="sum")


# weft parameter names that are not this module's state_dict keys (else the same).
def weft_to_torch_name(name):
    if name in ("llm.embedding", "llm.head"):
        return name + ".weight"
    module, _, rest = name.partition(".")
    if module == "llm":
        return name
    if rest.startswith("projector."):
        return f"encoders.{module}.{rest}"
    if rest == "class":
        rest = "class_token"
    return f"encoders.{module}.encoder.{rest}"


def module_of(torch_name):
    """weft's module of a parameter: "llm", "<enc>" or "<enc>.projector"."""
    parts = torch_name.split(".")
    if parts[0] == "llm":
        return "llm"
    return parts[1] + ".projector" if parts[2] == "projector" else parts[1]


# ------------------------------------------------------------------------------------------------
# The dump

def load_config(path):
    if not os.path.isfile(path):
        raise DumpError(f"{path}: missing")
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise DumpError(f"{path}: {e}") from None
    model = cfg.get("model")
    if not isinstance(model, dict) or "llm" not in model:
        raise DumpError(f"{path}: [model.llm] missing")
    train = cfg.get("train", {})

    def need(table, section, key, types):
        if key not in table:
            raise DumpError(f"{path}: [{section}] {key} missing")
        value = table[key]
        if not isinstance(value, types) or (types is not bool and isinstance(value, bool)):
            raise DumpError(f"{path}: [{section}] {key} = {value!r} has the wrong type")
        return value

    def optional(table, section, key, default):  # keys older dumps lack
        return need(table, section, key, type(default)) if key in table else default

    num = (int, float)
    llm = {k: need(model["llm"], "model.llm", k, t) for k, t in [
        ("vocab", int), ("hidden", int), ("layers", int), ("heads", int), ("kv_heads", int),
        ("ffn", int), ("rope_theta", num), ("norm_eps", num), ("tie_embeddings", bool),
        ("qkv_bias", bool), ("rope_scaling", str), ("frozen", bool)]}
    if llm["rope_scaling"] not in ("none", "llama3"):
        raise DumpError(f"{path}: [model.llm] rope_scaling = {llm['rope_scaling']!r} is not "
                             "supported (none or llama3)")
    llm["recompute"] = optional(model["llm"], "model.llm", "recompute", False)
    if llm["rope_scaling"] == "llama3":
        for k, t in [("rope_scaling_factor", num), ("rope_low_freq_factor", num),
                     ("rope_high_freq_factor", num), ("rope_original_max_position", int)]:
            llm[k] = need(model["llm"], "model.llm", k, t)
    encoders = {}
    for name, table in model.items():  # every [model.X] but llm, in file order
        if name == "llm":
            continue
        sec = f"model.{name}"
        c = {k: need(table, sec, k, t) for k, t in [
            ("kind", str), ("hidden", int), ("layers", int), ("heads", int), ("ffn", int),
            ("feature_layer", int), ("norm_eps", num), ("act", str), ("frozen", bool)]}
        c["recompute"] = optional(table, sec, "recompute", False)
        if c["act"] not in ("gelu", "quick_gelu", "gelu_tanh"):
            raise DumpError(f"{path}: [{sec}] act = {c['act']!r} is not supported")
        if c["kind"] == "vit":
            keys = [("class_token", bool), ("pre_norm", bool), ("patch_bias", bool),
                    ("image_size", int), ("channels", int), ("patch", int),
                    ("stem_channels", int), ("stem_layers", int)]
        elif c["kind"] == "whisper":
            keys = [("mels", int), ("frames", int)]
        else:
            raise DumpError(f"{path}: [{sec}] kind = {c['kind']!r} is not supported "
                                 "(vit or whisper)")
        c.update({k: need(table, sec, k, t) for k, t in keys})
        proj = table.get("projector")
        if not isinstance(proj, dict):
            raise DumpError(f"{path}: [{sec}.projector] missing")
        c["projector"] = {k: need(proj, sec + ".projector", k, t)
                          for k, t in [("kind", str), ("frozen", bool)]}
        if c["projector"]["kind"] not in ("mlp", "linear"):
            raise DumpError(f"{path}: [{sec}.projector] kind = {c['projector']['kind']!r} "
                                 "is not supported (mlp or linear)")
        encoders[name] = c
    opt = {k: need(train, "train", k, t) for k, t in [
        ("beta1", num), ("beta2", num), ("eps", num), ("weight_decay", num), ("grad_clip", num),
        ("precision", str)]}
    return llm, encoders, opt


def load_bench(path):
    if not os.path.isfile(path):
        raise DumpError(f"{path}: missing")
    try:
        with open(path) as f:
            bench = json.load(f)
        for key in ("warmup", "steps", "threads", "precision", "microbatches", "step",
                    "peak_flops"):
            if key not in bench:
                raise DumpError(f"{path}: field '{key}' missing")
        if len(bench["step"]) != bench["warmup"] + bench["steps"]:
            raise DumpError(f"{path}: 'step' has {len(bench['step'])} entries for warmup "
                                 f"{bench['warmup']} + steps {bench['steps']}")
        if bench["precision"] not in ("bf16", "fp32"):
            raise DumpError(f"{path}: precision = {bench['precision']!r} (bf16 or fp32)")
        for i, s in enumerate(bench["step"]):
            for key in ("lr", "targets", "tokens", "flops"):
                if key not in s:
                    raise DumpError(f"{path}: step[{i}] field '{key}' missing")
            if s["targets"] <= 0:
                raise DumpError(f"{path}: step[{i}] has targets = {s['targets']}")
    except (ValueError, TypeError) as e:
        raise DumpError(f"{path}: malformed: {e}") from None
    return bench


def load_step(path, microbatches, enc_tokens):
    """The microbatches of one step file: tensors plus the HF-style labels (-100 = ignore)."""
    t = load_safetensors(path)
    mbs = []
    for m in range(microbatches):
        def get(key, dtype):
            name = f"mb{m}.{key}"
            if name not in t:
                raise DumpError(f"{path}: tensor '{name}' missing")
            return t.pop(name).to(dtype)

        mb = {"tokens": get("tokens", torch.long), "positions": get("positions", torch.long),
              "doc": get("doc", torch.int32), "item": get("item", torch.int32),
              "target_rows": get("target_rows", torch.long), "targets": get("targets", torch.long),
              "enc": {}}
        for e, tokens in enumerate(enc_tokens):
            if f"mb{m}.enc{e}.inputs" not in t and f"mb{m}.enc{e}.rows" not in t:
                continue  # no items for encoder e in this microbatch
            inputs, rows = get(f"enc{e}.inputs", torch.float32), get(f"enc{e}.rows", torch.long)
            if rows.numel() != inputs.shape[0] * tokens:
                raise DumpError(f"{path}: mb{m}.enc{e}: {inputs.shape[0]} items make "
                                     f"{inputs.shape[0] * tokens} features for {rows.numel()} rows")
            mb["enc"][e] = (inputs, rows)
        labels = torch.full((mb["tokens"].numel(),), -100, dtype=torch.long)
        labels[mb["target_rows"]] = mb["targets"]
        mb["labels"] = labels
        mbs.append(mb)
    if t:
        raise DumpError(f"{path}: unexpected tensor '{next(iter(t))}'")
    return mbs


def build_model(directory, llm_cfg, enc_cfgs):
    path = os.path.join(directory, "model.safetensors")
    weights = load_safetensors(path)
    if "llm.embedding" not in weights:
        raise DumpError(f"{path}: tensor 'llm.embedding' missing")
    if llm_cfg["vocab"] == 0:  # "from the tokenizer": the checkpoint knows
        llm_cfg["vocab"] = weights["llm.embedding"].shape[0]
    model = MultimodalModel(llm_cfg, enc_cfgs)
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for name, value in weights.items():
            key = weft_to_torch_name(name)
            if key not in params:
                raise DumpError(f"{path}: tensor '{name}' is not a parameter of the model "
                                     "config.toml describes")
            if tuple(value.shape) != tuple(params[key].shape):
                raise DumpError(f"{path}: tensor '{name}' has shape {list(value.shape)}, "
                                     f"config.toml implies {list(params[key].shape)}")
            params[key].copy_(value)
            loaded.add(key)
    missing = [k for k in params if k not in loaded]
    if missing:
        raise DumpError(f"{path}: parameter for '{missing[0]}' missing")
    del weights
    # Frozen modules (weft's set_trainable).
    frozen = {"llm": llm_cfg["frozen"]}
    for name, c in enc_cfgs.items():
        frozen[name], frozen[name + ".projector"] = c["frozen"], c["projector"]["frozen"]
    for key, p in params.items():
        p.requires_grad_(not frozen[module_of(key)])
    return model


# ------------------------------------------------------------------------------------------------
# Training step

def grad_norm(params):
    """The global gradient norm as a 0-dim tensor (not read back)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    return torch.linalg.vector_norm(norms)


def to_device(mb, device):
    """A microbatch (load_step's dict) with every tensor on `device`."""
    out = {k: v.to(device) for k, v in mb.items() if k != "enc"}
    out["enc"] = {e: (inputs.to(device), rows.to(device))
                  for e, (inputs, rows) in mb["enc"].items()}
    return out


def main(argv):
    ap = argparse.ArgumentParser(description="PyTorch-eager reference of weft's training step on "
                                 "a `weft bench step --dump DIR` dump")
    ap.add_argument("dir", help="dump directory (config.toml, model.safetensors, "
                    "step-*.safetensors, bench.json)")
    ap.add_argument("--head", choices=("all", "targets"), default="all",
                    help="all: logits for every position + ignore_index labels (HF style, "
                    "default); targets: logits for the target rows only (as weft)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the parameters, optimizer state and batches live (default cpu; "
                    "cuda: the current CUDA device)")
    ap.add_argument("--json", metavar="OUT", help="also write the result to this file")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise DumpError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    bench = load_bench(os.path.join(args.dir, "bench.json"))
    llm_cfg, enc_cfgs, opt = load_config(os.path.join(args.dir, "config.toml"))
    if bench["threads"] > 0:
        torch.set_num_threads(int(bench["threads"]))
    model = build_model(args.dir, llm_cfg, enc_cfgs)
    if cuda:
        model.to(device)
    enc_tokens = [enc.tokens for enc in model.encoders.values()]
    steps = []
    for i in range(len(bench["step"])):
        steps.append(load_step(os.path.join(args.dir, f"step-{i:05d}.safetensors"),
                               bench["microbatches"], enc_tokens))
        if cuda:
            steps[-1] = [to_device(mb, device) for mb in steps[-1]]

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise DumpError(f"{os.path.join(args.dir, 'config.toml')}: every module is frozen")
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": opt["weight_decay"]},
         {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}],
        lr=bench["step"][0]["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"])
    bf16 = bench["precision"] == "bf16"
    clip = float(opt["grad_clip"])

    try:  # peak RSS from here on
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    if cuda:  # peak device memory from here on
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    losses, norms, seconds = [], [], []
    # Step i's time runs from the previous step's finish to its own. On CUDA step i + 1 is queued
    # before step i is read (its loss and norm stay on the GPU until an event says step i is
    # done), as weft does: the time is the GPU's pace. On the CPU each step runs alone.
    pending = None
    if cuda:
        torch.cuda.synchronize(device)
    last = time.perf_counter()

    def finish(i, loss_total, norm, done, next_in_flight):
        # On CUDA loss_total and norm are a pinned host copy made behind step i's work: reading
        # them after the event waits for step i only (float() of a device tensor would wait for
        # the whole stream, step i + 1 included).
        nonlocal last
        if done is not None:
            done.synchronize()
            loss_total, norm = loss_total.tolist()
        finished = time.perf_counter()
        losses.append(float(loss_total))
        norms.append(float(norm))
        if i >= bench["warmup"]:
            seconds.append(finished - last)
        # As weft's bench: with a step in flight the bookkeeping is the next step's time.
        last = finished if next_in_flight else time.perf_counter()

    for i, (info, mbs) in enumerate(zip(bench["step"], steps)):
        if i == bench["warmup"]:
            # As weft's bench: the timed steps start on an idle device, the clock started once
            # the warm-up is done (not when its last step is read after the first timed step is
            # queued, by when the GPU has run most of that step).
            if pending is not None:
                finish(*pending, next_in_flight=False)
                pending = None
            if cuda:
                torch.cuda.synchronize(device)
            last = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_total = torch.zeros((), dtype=torch.float64, device=device) if cuda else 0.0
        for mb in mbs:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(mb, args.head) / info["targets"]
            loss.backward()
            loss_total += loss.detach() if cuda else loss.item()
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
        else:
            norm = grad_norm(trainable)
        if not cuda:
            norm = float(norm)
        for group in optimizer.param_groups:
            group["lr"] = info["lr"]
        optimizer.step()
        done = None
        if cuda:
            scalars = torch.empty(2, dtype=torch.float64, pin_memory=True)
            scalars.copy_(torch.stack([loss_total, norm.double()]), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            loss_total, norm = scalars, None
        if pending is not None:
            finish(*pending, next_in_flight=cuda)
        pending = (i, loss_total, norm, done)
        if not cuda:
            finish(*pending, next_in_flight=False)
            pending = None
    if pending is not None:
        finish(*pending, next_in_flight=False)

    peak = read_status_bytes("VmHWM")
    device_peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    timed = bench["step"][bench["warmup"]:]
    total_s = sum(seconds)
    result = {
        "impl": "pytorch-eager",
        "torch": torch.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "head": args.head,
        "precision": bench["precision"],
        "losses": losses,
        "grad_norms": norms,
        "step_seconds": seconds,
        "median_step_seconds": statistics.median(seconds) if seconds else 0.0,
        "tokens_per_second": sum(s["tokens"] for s in timed) / total_s if total_s > 0 else 0.0,
        "mfu": (sum(s["flops"] for s in timed) / total_s / bench["peak_flops"]
                if total_s > 0 and bench["peak_flops"] > 0 else 0.0),
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": BASELINE_RSS,
        "step_peak_bytes": device_peak if cuda else peak - BASELINE_RSS,
    }
    if cuda:
        result["device_peak_bytes"] = device_peak  # weft's field for the same quantity
        result["device_name"] = torch.cuda.get_device_name(device)
        result["attention"] = "sdpa" if _HAS_SDPA else "eager"
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            raise DumpError(f"{args.json}: cannot write: {e.strerror}") from None
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except DumpError as e:
        print(f"eager_reference: error: {e}", file=sys.stderr)
        sys.exit(1)
