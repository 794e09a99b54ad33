#include "weft/dist/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "weft/core/error.h"

namespace weft::dist {

namespace {

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

struct Rank {
  pid_t pid = -1;
  int out_fd = -1;  // read end of the rank's stdout+stderr pipe
  std::string partial;
  std::string last_error;  // the last output line that mentions an error
  bool running = false;
  int status = 0;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  return "ended with status " + std::to_string(status);
}

void emit(int rank, Rank& r, const char* data, size_t n) {
  r.partial.append(data, n);
  size_t start = 0, nl;
  while ((nl = r.partial.find('\n', start)) != std::string::npos) {
    const std::string line = r.partial.substr(start, nl - start);
    std::printf("[rank %d] %s\n", rank, line.c_str());
    if (line.find("error") != std::string::npos) r.last_error = line;
    start = nl + 1;
  }
  r.partial.erase(0, start);
  std::fflush(stdout);
}

}  // namespace

int intra_op_threads(int64_t requested) {
  if (requested > 0) return static_cast<int>(requested);
  cpu_set_t set;
  CPU_ZERO(&set);
  int cores = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  long local = 1;
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE"); v && *v) {
    char* end = nullptr;
    local = std::strtol(v, &end, 10);
    WEFT_CHECK(*end == '\0' && local >= 1, "LOCAL_WORLD_SIZE = \"", v,
               "\": expected the number of ranks on this machine, an integer >= 1");
  }
  return local >= cores ? 1 : cores / static_cast<int>(local);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  WEFT_CHECK(fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  WEFT_CHECK(ok, "could not find a free port: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

namespace {

// One attempt of the job: every rank started, run to completion or first failure.
int run_once(const LaunchOptions& opts, int attempt) {
  const int port = opts.master_port > 0 ? opts.master_port : free_port();
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<Rank> ranks(static_cast<size_t>(opts.nproc));
  for (int r = 0; r < opts.nproc; ++r) {
    int fds[2];
    WEFT_CHECK(::pipe(fds) == 0, "weft launch: pipe() failed: ", std::strerror(errno));
    const pid_t pid = ::fork();
    WEFT_CHECK(pid >= 0, "weft launch: fork() failed: ", std::strerror(errno));
    if (pid == 0) {  // child: own process group, dies with the launcher
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(opts.nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(opts.nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", opts.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("WEFT_RESTART", std::to_string(attempt).c_str(), 1);
      std::vector<char*> argv;
      for (const auto& a : opts.command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "weft launch: error: cannot run '%s': %s\n", argv[0],
                   std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    ::close(fds[1]);
    ranks[r].pid = pid;
    ranks[r].out_fd = fds[0];
    ranks[r].running = true;
  }
  std::fprintf(stderr, "weft launch: %d ranks, rendezvous at %s:%d\n", opts.nproc,
               opts.master_addr.c_str(), port);

  using clock = std::chrono::steady_clock;
  int failed = -1;  // first rank that failed
  bool stopping = false;
  clock::time_point kill_at{};
  auto stop_all = [&](int sig) {
    for (const Rank& r : ranks)
      if (r.running) ::kill(-r.pid, sig);
  };
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int r = 0; r < opts.nproc; ++r)
      if (ranks[r].out_fd >= 0) {
        fds.push_back({ranks[r].out_fd, POLLIN, 0});
        who.push_back(r);
      }
    bool any_running = false;
    for (const Rank& r : ranks) any_running = any_running || r.running;
    if (fds.empty() && !any_running) break;
    if (!fds.empty())
      ::poll(fds.data(), fds.size(), 100);
    else
      ::usleep(100 * 1000);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Rank& r = ranks[who[i]];
      char buf[4096];
      const ssize_t n = ::read(r.out_fd, buf, sizeof buf);
      if (n > 0) {
        emit(who[i], r, buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        if (!r.partial.empty()) emit(who[i], r, "\n", 1);
        ::close(r.out_fd);
        r.out_fd = -1;
      }
    }
    int status;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (int r = 0; r < opts.nproc; ++r) {
        if (ranks[r].pid != pid) continue;
        ranks[r].running = false;
        ranks[r].status = status;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed < 0 && !stopping) failed = r;
      }
    }
    if ((failed >= 0 || g_interrupted) && !stopping) {
      stopping = true;
      stop_all(SIGTERM);
      kill_at =
          clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts.grace_seconds * 1000));
    }
    if (stopping && clock::now() >= kill_at) {
      stop_all(SIGKILL);
      kill_at = clock::now() + std::chrono::hours(1);
    }
  }
  if (failed >= 0) {
    const Rank& r = ranks[failed];
    std::fprintf(stderr, "weft launch: error: rank %d %s; stopped the other ranks%s%s\n", failed,
                 describe(r.status).c_str(),
                 r.last_error.empty() ? "" : ". Its last error: ", r.last_error.c_str());
    const bool input = WIFEXITED(r.status) && WEXITSTATUS(r.status) == kInputErrorExit;
    return input ? kInputErrorExit : 1;
  }
  if (g_interrupted) {
    std::fprintf(stderr, "weft launch: interrupted; stopped every rank\n");
    return 130;
  }
  return 0;
}

}  // namespace

int launch(const LaunchOptions& opts) {
  WEFT_CHECK(opts.nproc >= 1, "weft launch: --nproc must be >= 1, got ", opts.nproc);
  WEFT_CHECK(opts.max_restarts >= 0, "weft launch: --max-restarts must be >= 0, got ",
             opts.max_restarts);
  WEFT_CHECK(!opts.command.empty(),
             "weft launch: no command (usage: weft launch --nproc N -- "
             "weft train CONFIG ...)");
  for (int attempt = 0;; ++attempt) {
    const int rc = run_once(opts, attempt);
    if (rc == 0 || g_interrupted || attempt >= opts.max_restarts) return rc;
    if (rc == kInputErrorExit) {
      std::fprintf(stderr,
                   "weft launch: not restarted: the input is at fault, and would be again\n");
      return rc;
    }
    std::fprintf(stderr,
                 "weft launch: restart %d of %d: starting every rank again (weft train "
                 "continues from the run's last complete checkpoint)\n",
                 attempt + 1, opts.max_restarts);
  }
}

}  // namespace weft::dist
