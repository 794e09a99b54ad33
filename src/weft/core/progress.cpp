#include "weft/core/progress.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>

namespace weft {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long s = std::lround(seconds);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = bytes;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

bool Progress::stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

Progress::Progress(int64_t first_step, int64_t total_steps, int64_t log_every, bool tty)
    : first_step_(first_step),
      total_(total_steps),
      log_every_(log_every),
      tty_(tty),
      start_seconds_(now_seconds()) {}

void Progress::update(int64_t step, double loss, double tokens_per_second, double lr) {
  const double elapsed = now_seconds() - start_seconds_;
  const int64_t done = step - first_step_;
  const double eta =
      done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - step) : NAN;
  if (tty_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(total_, 1));
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r[%s] %lld/%lld  loss %.4f  %.0f tok/s  lr %.2e  ETA %s   ", bar.c_str(),
                 static_cast<long long>(step), static_cast<long long>(total_), loss,
                 tokens_per_second, lr, format_duration(eta).c_str());
    drawn_ = true;
  } else if (step % log_every_ == 0 || step == total_ || step == first_step_ + 1) {
    std::fprintf(stderr, "step %lld/%lld  loss %.4f  %.0f tok/s  lr %.2e  elapsed %s  ETA %s\n",
                 static_cast<long long>(step), static_cast<long long>(total_), loss,
                 tokens_per_second, lr, format_duration(elapsed).c_str(),
                 format_duration(eta).c_str());
  }
  std::fflush(stderr);
}

void Progress::message(const std::string& text) {
  if (drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

void Progress::finish() {
  if (drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
  std::fflush(stderr);
}

}  // namespace weft
