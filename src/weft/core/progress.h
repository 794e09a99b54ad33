// Training progress on stderr: a one-line bar redrawn in place on a terminal (step, loss,
// tokens/s, ETA), plain log lines every `log_every` steps otherwise. Single-threaded.
#pragma once

#include <cstdint>
#include <string>

namespace weft {

class Progress {
 public:
  Progress(int64_t first_step, int64_t total_steps, int64_t log_every, bool tty);
  // `step` = optimizer steps completed so far.
  void update(int64_t step, double loss, double tokens_per_second, double lr);
  // Ends the bar line (terminal) so following output starts on a fresh line.
  void finish();
  // Prints a message without corrupting the bar.
  void message(const std::string& text);
  static bool stderr_is_tty();

 private:
  int64_t first_step_, total_, log_every_;
  bool tty_, drawn_ = false;
  double start_seconds_;
};

// Seconds on a monotonic clock.
double now_seconds();
// "1:02:03" / "2:03".
std::string format_duration(double seconds);
// "512 B" / "1.50 MiB": binary units, two decimals above bytes.
std::string format_bytes(double bytes);

}  // namespace weft
