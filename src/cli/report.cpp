#include "cli/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "weft/core/error.h"

namespace weft::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string read_text(const fs::path& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, path.string(), ": cannot read the ", what);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

json read_json(const fs::path& path, const char* what) {
  try {
    return json::parse(read_text(path, what));
  } catch (const json::exception& e) {  // parse_error, out_of_range (a number too large)
    WEFT_FAIL(path.string(), ": the ", what, " is not valid JSON (", e.what(), ")");
  }
}

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v, int digits = 3) {
  if (!std::isfinite(v)) return "–";
  char buf[64];
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-3))
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  else
    std::snprintf(buf, sizeof buf, "%.*f", a >= 100 ? 0 : a >= 10 ? 1 : digits, v);
  return buf;
}

// About n round-numbered ticks covering [lo, hi].
std::vector<double> ticks(double lo, double hi, int n) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / n, mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  for (double t = std::ceil(lo / step) * step; t <= hi + 1e-9 * step; t += step) out.push_back(t);
  return out;
}

const char* const kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                                "#76b7b2", "#edc948", "#b07aa1", "#9c755f"};

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;
};

// A line chart: x and y axes with ticks, one polyline (and dots when few points) per series.
std::string line_chart(const std::string& id, const std::string& xlabel, const std::string& ylabel,
                       const std::vector<Series>& series) {
  const double W = 760, H = 260, L = 64, R = 16, T = 16, B = 40;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const Series& s : series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  std::ostringstream os;
  os << "<svg class=\"chart\" id=\"" << id << "\" width=\"" << W << "\" height=\"" << H
     << "\" viewBox=\"0 0 " << W << ' ' << H << "\" role=\"img\">\n";
  if (x0 > x1) {
    os << "<text x=\"" << L << "\" y=\"" << H / 2 << "\">no data</text></svg>\n";
    return os.str();
  }
  if (x1 == x0) x0 -= 0.5, x1 += 0.5;
  if (y1 == y0) y0 -= std::max(0.5, std::fabs(y0) * 0.1), y1 += std::max(0.5, std::fabs(y1) * 0.1);
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad, y1 += pad;
  const auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  const auto Y = [&](double y) { return T + (y1 - y) / (y1 - y0) * (H - T - B); };
  os << "<rect class=\"plot\" x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R
     << "\" height=\"" << H - T - B << "\"/>\n";
  for (double t : ticks(y0, y1, 5))
    os << "<line class=\"grid\" x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << Y(t)
       << "\" y2=\"" << Y(t) << "\"/><text class=\"tick\" x=\"" << L - 6 << "\" y=\"" << Y(t) + 4
       << "\" text-anchor=\"end\">" << num(t) << "</text>\n";
  for (double t : ticks(x0, x1, 8))
    os << "<text class=\"tick\" x=\"" << X(t) << "\" y=\"" << H - B + 16
       << "\" text-anchor=\"middle\">" << num(t) << "</text>\n";
  os << "<text class=\"label\" x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 4
     << "\" text-anchor=\"middle\">" << esc(xlabel) << "</text>\n"
     << "<text class=\"label\" transform=\"translate(14," << (T + H - B) / 2
     << ") rotate(-90)\" text-anchor=\"middle\">" << esc(ylabel) << "</text>\n";
  for (size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    os << "<polyline class=\"series\" stroke=\"" << s.color << "\" points=\"";
    for (const auto& [x, y] : s.points)
      if (std::isfinite(y)) os << X(x) << ',' << Y(y) << ' ';
    os << "\"><title>" << esc(s.name) << "</title></polyline>\n";
    if (s.points.size() <= 60)
      for (const auto& [x, y] : s.points)
        if (std::isfinite(y))
          os << "<circle cx=\"" << X(x) << "\" cy=\"" << Y(y) << "\" r=\"2.5\" fill=\"" << s.color
             << "\"><title>" << esc(s.name) << " at " << num(x) << ": " << num(y, 4)
             << "</title></circle>\n";
    if (series.size() > 1)
      os << "<text class=\"legend\" x=\"" << L + 10 << "\" y=\"" << T + 16 + 16 * k << "\" fill=\""
         << s.color << "\">" << esc(s.name) << "</text>\n";
  }
  os << "</svg>\n";
  return os.str();
}

// ---- timelines --------------------------------------------------------------------------------

struct Event {
  std::string name, category;
  int64_t rank = 0;
  double start = 0, seconds = 0;
};

// A Chrome trace (plan/trace.h: {"name", "cat", "ph": "X", "ts", "dur", "tid": rank}, µs), times
// made relative to its first event.
std::vector<Event> read_trace(const fs::path& path) {
  const json j = read_json(path, "trace");
  WEFT_CHECK(j.is_array(), path.string(), ": expected a Chrome trace (a JSON array of events)");
  std::vector<Event> out;
  double first = 1e300;
  for (size_t i = 0; i < j.size(); ++i) {
    const json& e = j[i];
    const bool ok = e.is_object() && e.contains("name") && e["name"].is_string() &&
                    e.contains("ts") && e["ts"].is_number() && e.contains("dur") &&
                    e["dur"].is_number() && e.contains("tid") && e["tid"].is_number_integer();
    WEFT_CHECK(ok, path.string(), ": event ", i,
               ": expected {\"name\", \"cat\", \"ts\", \"dur\", \"tid\"} (a weft trace)");
    Event ev;
    ev.name = e["name"].get<std::string>();
    ev.category = e.contains("cat") && e["cat"].is_string() ? e["cat"].get<std::string>() : "";
    ev.rank = e["tid"].get<int64_t>();
    ev.start = e["ts"].get<double>() * 1e-6;
    ev.seconds = e["dur"].get<double>() * 1e-6;
    first = std::min(first, ev.start);
    out.push_back(std::move(ev));
  }
  for (Event& e : out) e.start -= first;
  return out;
}

struct Timeline {
  std::string title;
  std::vector<Event> events;
  std::vector<int64_t> rows;  // ranks drawn, in order
  std::string note;           // e.g. which ranks were left out
  double span() const {
    double s = 0;
    for (const Event& e : events) s = std::max(s, e.start + e.seconds);
    return s;
  }
};

// Up to `limit` ranks: every one, or the first of each distinct stage set (the simulator's
// per-rank "stages"), then evenly spaced.
void choose_rows(Timeline* t, const std::map<int64_t, std::string>& stages, size_t limit = 32) {
  std::set<int64_t> ranks;
  for (const Event& e : t->events) ranks.insert(e.rank);
  std::vector<int64_t> all(ranks.begin(), ranks.end());
  if (all.size() <= limit) {
    t->rows = all;
    return;
  }
  std::set<std::string> seen;
  for (int64_t r : all) {
    auto it = stages.find(r);
    if (it != stages.end() && seen.insert(it->second).second && t->rows.size() < limit)
      t->rows.push_back(r);
  }
  for (size_t i = 0; t->rows.size() < limit && i < limit; ++i) {
    const int64_t r = all[i * all.size() / limit];
    if (std::find(t->rows.begin(), t->rows.end(), r) == t->rows.end()) t->rows.push_back(r);
  }
  std::sort(t->rows.begin(), t->rows.end());
  t->note = "showing " + std::to_string(t->rows.size()) + " of " + std::to_string(all.size()) +
            " ranks (the first rank of each distinct set of stages, then evenly spaced)";
}

std::string module_of(const Event& e) {
  const size_t sp = e.name.find(' ');
  return sp == std::string::npos ? e.name : e.name.substr(0, sp);
}

std::string color_of(const Event& e, std::map<std::string, size_t>* modules) {
  if (e.category == "collective") return "#9a9a9a";
  if (e.category == "optimizer") return "#6b4c9a";
  if (e.category == "data") return "#c9a26b";
  auto it = modules->emplace(module_of(e), modules->size()).first;
  return kPalette[(2 * it->second + (e.category == "backward" ? 1 : 0)) % 8];
}

std::string timeline_svg(const std::string& id, const Timeline& t, double span,
                         std::map<std::string, size_t>* modules) {
  const double W = 1000, L = 70, R = 12, row = 16, T = 8, B = 30;
  const double H = T + row * static_cast<double>(t.rows.size()) + B;
  if (!(span > 0)) span = 1;
  const auto X = [&](double s) { return L + s / span * (W - L - R); };
  std::ostringstream os;
  os << "<svg class=\"timeline\" id=\"" << id << "\" width=\"" << W << "\" height=\"" << H
     << "\" viewBox=\"0 0 " << W << ' ' << H << "\" role=\"img\">\n";
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < t.rows.size(); ++i) {
    index[t.rows[i]] = i;
    const double y = T + row * static_cast<double>(i);
    os << "<text class=\"tick\" x=\"" << L - 6 << "\" y=\"" << y + row - 4
       << "\" text-anchor=\"end\">rank " << t.rows[i] << "</text>\n";
  }
  for (const Event& e : t.events) {
    auto it = index.find(e.rank);
    if (it == index.end() || e.seconds <= 0) continue;
    const double y = T + row * static_cast<double>(it->second) + 1;
    os << "<rect x=\"" << X(e.start) << "\" y=\"" << y << "\" width=\""
       << std::max(0.4, X(e.start + e.seconds) - X(e.start)) << "\" height=\"" << row - 2
       << "\" fill=\"" << color_of(e, modules) << "\"><title>" << esc(e.name) << " ("
       << esc(e.category) << "): " << num(e.seconds * 1e3, 4) << " ms at " << num(e.start * 1e3, 4)
       << " ms</title></rect>\n";
  }
  const double axis = T + row * static_cast<double>(t.rows.size());
  os << "<line class=\"axis\" x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << axis << "\" y2=\""
     << axis << "\"/>\n";
  for (double ms : ticks(0, span * 1e3, 10))
    os << "<text class=\"tick\" x=\"" << X(ms * 1e-3) << "\" y=\"" << axis + 16
       << "\" text-anchor=\"middle\">" << num(ms) << " ms</text>\n";
  os << "</svg>\n";
  return os.str();
}

std::string legend(const std::map<std::string, size_t>& modules) {
  std::ostringstream os;
  os << "<p class=\"legend\">";
  for (const auto& [name, i] : modules)
    os << "<span style=\"background:" << kPalette[(2 * i) % 8] << "\"></span>" << esc(name)
       << " forward <span style=\"background:" << kPalette[(2 * i + 1) % 8] << "\"></span>"
       << esc(name) << " backward ";
  os << "<span style=\"background:#9a9a9a\"></span>collective <span "
        "style=\"background:#6b4c9a\"></span>optimizer <span "
        "style=\"background:#c9a26b\"></span>data</p>\n";
  return os.str();
}

// ---- inputs -----------------------------------------------------------------------------------

struct Simulation {
  fs::path path;
  json j;
  Timeline timeline;
  std::map<int64_t, std::string> stages;  // rank → "vision s0 | llm s1"
};

Simulation read_simulation(const fs::path& path) {
  Simulation s;
  s.path = path;
  s.j = read_json(path, "simulation");
  for (const char* key : {"step_seconds", "mfu", "bubble_fraction", "ranks"})
    WEFT_CHECK(s.j.is_object() && s.j.contains(key), path.string(), ": ", key,
               ": missing (expected the JSON `weft simulate` prints)");
  for (const char* key : {"step_seconds", "mfu", "bubble_fraction"})
    WEFT_CHECK(s.j[key].is_number() && s.j[key].get<double>() >= 0, path.string(), ": ", key, " = ",
               s.j[key].dump(), ": expected a number >= 0");
  WEFT_CHECK(s.j["ranks"].is_array(), path.string(), ": ranks: expected a list");
  try {
    for (const json& r : s.j["ranks"]) {
      std::string st;
      for (const json& x : r.value("stages", json::array()))
        st += (st.empty() ? "" : " | ") + x.get<std::string>();
      s.stages[r.value("rank", int64_t{0})] = st;
    }
  } catch (const json::exception& e) {
    WEFT_FAIL(path.string(),
              ": ranks: expected a list of {\"rank\": integer, \"stages\": [names]} "
              "as `weft simulate` prints (",
              e.what(), ")");
  }
  s.timeline.title = "Predicted (simulator)";
  if (s.j.contains("trace") && s.j["trace"].is_string()) {
    fs::path trace = s.j["trace"].get<std::string>();
    if (trace.is_relative() && !fs::exists(trace)) trace = path.parent_path() / trace;
    WEFT_CHECK(fs::exists(trace), path.string(), ": trace = \"", s.j["trace"].get<std::string>(),
               "\": no such file (also looked next to the simulation JSON)");
    s.timeline.events = read_trace(trace);
  }
  choose_rows(&s.timeline, s.stages);
  return s;
}

struct Run {
  fs::path dir;
  std::vector<json> metrics;
  json summary;
  std::string plan_html;  // plan.json's table; empty without one
  Timeline timeline;
};

std::string plan_table(const json& plan);

Run read_run(const fs::path& dir) {
  Run run;
  run.dir = dir;
  const fs::path metrics = dir / "metrics.jsonl";
  WEFT_CHECK(fs::exists(metrics), dir.string(), ": not a weft run directory (no metrics.jsonl)");
  std::istringstream lines(read_text(metrics, "metrics"));
  std::string line;
  for (int64_t n = 1; std::getline(lines, line); ++n) {
    if (line.empty()) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {  // parse_error, out_of_range (a number too large)
      WEFT_FAIL(metrics.string(), ":", n, ": not valid JSON (", e.what(), ")");
    }
    WEFT_CHECK(j.is_object() && j.contains("step") && j.contains("loss"), metrics.string(), ":", n,
               ": expected a metrics line with \"step\" and \"loss\"");
    WEFT_CHECK(j["step"].is_number_integer() && j["step"].get<int64_t>() >= 1, metrics.string(),
               ":", n, ": step = ", j["step"].dump(), ": expected a step number >= 1");
    run.metrics.push_back(std::move(j));
  }
  WEFT_CHECK(!run.metrics.empty(), metrics.string(),
             ": no steps recorded (the run stopped before its first step finished)");
  if (fs::exists(dir / "summary.json")) {
    run.summary = read_json(dir / "summary.json", "summary");
    WEFT_CHECK(
        !run.summary.contains("world_size") || (run.summary["world_size"].is_number_integer() &&
                                                run.summary["world_size"].get<int64_t>() >= 1),
        (dir / "summary.json").string(), ": world_size: expected a rank count >= 1");
  }
  if (fs::exists(dir / "plan.json")) {
    const fs::path path = dir / "plan.json";
    try {
      run.plan_html = plan_table(read_json(path, "plan"));
    } catch (const json::exception& e) {
      WEFT_FAIL(path.string(), ": not the plan `weft train` writes (", e.what(), ")");
    }
  }
  run.timeline.title = "Measured (trace.json)";
  if (fs::exists(dir / "trace.json")) run.timeline.events = read_trace(dir / "trace.json");
  choose_rows(&run.timeline, {});
  return run;
}

double number(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
}

Series series(const std::vector<json>& metrics, const char* key, const std::string& name,
              const char* color) {
  Series s{name, color, {}};
  for (const json& m : metrics)
    if (m.contains(key) && m[key].is_number())
      s.points.push_back({number(m, "step"), m[key].get<double>()});
  return s;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string card(const std::string& label, const std::string& value) {
  return "<div class=\"card\"><div class=\"v\">" + esc(value) + "</div><div class=\"k\">" +
         esc(label) + "</div></div>";
}

std::string plan_table(const json& plan) {
  if (!plan.is_object() || !plan.contains("modules")) return "";
  std::ostringstream os;
  os << "<table><tr><th>module</th><th>layout</th><th>ranks</th><th>stages</th><th>frozen</th>"
        "</tr>\n";
  for (const json& m : plan["modules"]) {
    const json& l = m.value("layout", json::object());
    os << "<tr><td>" << esc(m.value("name", "")) << "</td><td>dp " << l.value("dp", 1) << " tp "
       << l.value("tp", 1) << " pp " << l.value("pp", 1) << " cp " << l.value("cp", 1)
       << (l.value("vp", 1) > 1 ? " vp " + std::to_string(l.value("vp", 1)) : std::string())
       << "</td><td>" << esc(m.value("ranks", json::array()).dump()) << "</td><td>"
       << esc(m.value("stage_boundaries", json::array()).dump()) << "</td><td>"
       << (m.value("frozen", false) ? "yes" : "") << "</td></tr>\n";
  }
  os << "</table>\n<p class=\"sub\">placement " << esc(plan.value("placement", "")) << ", "
     << plan.value("microbatches", 1) << " microbatches, schedule "
     << esc(plan.value("schedule", "")) << "</p>\n";
  return os.str();
}

const char* kStyle =
    R"(body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1040px;color:#222}
h1{font-size:22px;margin:0}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:14px 0 4px}.sub{color:#666;margin:2px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:110px}
.card .v{font-size:18px;font-weight:600}.card .k{color:#666;font-size:12px}
svg{display:block;background:#fff}.plot{fill:none;stroke:#ccc}.grid{stroke:#eee}
.axis{stroke:#999}.tick{font-size:10px;fill:#555}.label{font-size:11px;fill:#333}
.legend{font-size:12px}.series{fill:none;stroke-width:1.8}
p.legend span{display:inline-block;width:11px;height:11px;margin:0 4px 0 10px;vertical-align:-1px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
)";

std::string page(const std::string& title, const std::string& body) {
  return "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>" + esc(title) +
         "</title>\n<style>\n" + kStyle + "</style></head>\n<body>\n" + body + "</body></html>\n";
}

// The timelines one above the other on one time axis.
std::string timelines(const std::vector<const Timeline*>& list) {
  double span = 0;
  for (const Timeline* t : list) span = std::max(span, t->span());
  std::map<std::string, size_t> modules;
  std::string svgs;
  for (size_t i = 0; i < list.size(); ++i) {
    const Timeline& t = *list[i];
    svgs += "<h3>" + esc(t.title) + "</h3>\n";
    if (t.events.empty()) {
      svgs += "<p class=\"sub\">no trace</p>\n";
      continue;
    }
    if (!t.note.empty()) svgs += "<p class=\"sub\">" + esc(t.note) + "</p>\n";
    svgs += "<p class=\"sub\">span " + num(t.span() * 1e3, 4) + " ms</p>\n";
    svgs += timeline_svg("timeline-" + std::to_string(i), t, span, &modules);
  }
  return "<h2>Pipeline timeline</h2>\n" + legend(modules) + svgs;
}

std::string simulation_section(const Simulation& s) {
  const json& j = s.j;
  std::ostringstream os;
  os << "<div class=\"cards\">" << card("predicted step", num(number(j, "step_seconds"), 4) + " s")
     << card("tokens/s", num(number(j, "tokens_per_second"), 4))
     << card("MFU", num(100 * number(j, "mfu"), 3) + "%")
     << card("MFU, LLM only", num(100 * number(j, "mfu_llm_only"), 3) + "%")
     << card("LLM bubble", num(100 * number(j, "bubble_fraction"), 3) + "%")
     << card("memory fits", j.value("memory_fits", true) ? "yes" : "NO") << "</div>\n";
  Series busy{"busy (compute + TP/CP)", kPalette[0], {}},
      coll{"exposed collectives", kPalette[3], {}}, mem{"peak memory (GiB)", kPalette[2], {}};
  for (const json& r : j["ranks"]) {
    const double rank = static_cast<double>(r.value("rank", int64_t{0}));
    busy.points.push_back({rank, number(r, "busy_seconds")});
    coll.points.push_back({rank, number(r, "collective_seconds")});
    mem.points.push_back({rank, number(r, "peak_memory_bytes") / (1024.0 * 1024 * 1024)});
  }
  os << "<h2>Per rank</h2>\n"
     << line_chart("ranks-time", "rank", "seconds per step", {busy, coll})
     << line_chart("ranks-memory", "rank", "GiB", {mem});
  if (j.contains("plan")) os << "<h2>Plan</h2>\n" << plan_table(j["plan"]);
  return os.str();
}

struct ReportArgs {
  std::string input, sim, out;
};

int run_report(const ReportArgs& a) {
  const fs::path input = a.input;
  WEFT_CHECK(fs::exists(input), a.input, ": no such run directory or simulation JSON");
  std::unique_ptr<Simulation> sim;
  if (!a.sim.empty()) sim = std::make_unique<Simulation>(read_simulation(a.sim));
  std::ostringstream body;
  fs::path out = a.out;
  if (fs::is_directory(input)) {
    const Run run = read_run(input);
    if (out.empty()) out = input / "report.html";
    body << "<h1>weft report</h1>\n<p class=\"sub\">run " << esc(input.string()) << "</p>\n";
    std::vector<double> steps, tps, mfu;
    for (const json& m : run.metrics) {
      if (number(m, "step") > 1) steps.push_back(number(m, "step_seconds"));
      tps.push_back(number(m, "tokens_per_second"));
      mfu.push_back(number(m, "mfu"));
    }
    const json& s = run.summary;
    body << "<div class=\"cards\">" << card("steps", std::to_string(run.metrics.size()))
         << card("loss", num(number(run.metrics.front(), "loss"), 4) + " → " +
                             num(number(run.metrics.back(), "loss"), 4))
         << card("median step", num(median(steps), 4) + " s")
         << card("median tokens/s", num(median(tps), 4))
         << card("median MFU", num(100 * median(mfu), 3) + "%");
    if (s.is_object() && s.contains("world_size"))
      body << card("ranks", std::to_string(s["world_size"].get<int64_t>()));
    if (sim)
      body << card("predicted step", num(number(sim->j, "step_seconds"), 4) + " s")
           << card("measured / predicted", num(median(steps) / number(sim->j, "step_seconds"), 3));
    body << "</div>\n<h2>Loss</h2>\n"
         << line_chart("loss", "step", "loss", {series(run.metrics, "loss", "loss", kPalette[0])})
         << "<h2>Throughput</h2>\n"
         << line_chart("throughput", "step", "tokens/s",
                       {series(run.metrics, "tokens_per_second", "tokens/s", kPalette[1])})
         << line_chart("mfu", "step", "MFU", {series(run.metrics, "mfu", "MFU", kPalette[4])});
    // Where each step's time went on rank 0 (metrics.jsonl's parts of step_seconds; the
    // exposed gradient reduction and the pipeline's receive waits are part of compute).
    std::vector<Series> parts;
    const std::pair<const char*, const char*> part_keys[] = {
        {"compute_seconds", "forward + backward + reduction"},
        {"grad_sync_seconds", "of which: exposed gradient reduction"},
        {"p2p_wait_seconds", "of which: waiting for pipeline messages"},
        {"collective_wait_seconds", "of which: in TP / CP / EP / SP collectives"},
        {"data_seconds", "data"},
        {"optimizer_seconds", "optimizer"},
        {"norm_seconds", "gradient norm"}};
    for (size_t k = 0; k < std::size(part_keys); ++k) {
      Series p = series(run.metrics, part_keys[k].first, part_keys[k].second,
                        kPalette[k % std::size(kPalette)]);
      if (!p.points.empty()) parts.push_back(std::move(p));
    }
    if (!parts.empty())
      body << "<h2>Where the time went</h2>\n<p class=\"sub\">seconds per step on rank 0</p>\n"
           << line_chart("time", "step", "seconds", parts);
    body << "<h2>Per-microbatch balance</h2>\n<p class=\"sub\">max / mean work of the step's "
            "microbatches (1 = perfectly even); CP: slowest / mean context-parallel rank</p>\n";
    const Series mb = series(run.metrics, "microbatch_imbalance", "microbatches", kPalette[2]);
    const Series cp = series(run.metrics, "cp_imbalance", "context parallel", kPalette[3]);
    std::vector<Series> balance = {mb};
    if (!cp.points.empty()) balance.push_back(cp);
    body << line_chart("balance", "step", "max / mean", balance);
    std::vector<const Timeline*> list = {&run.timeline};
    if (sim) list.push_back(&sim->timeline);
    body << timelines(list);
    if (!run.plan_html.empty()) body << "<h2>Plan</h2>\n" << run.plan_html;
    if (sim) body << "<h2>Prediction</h2>\n" << simulation_section(*sim);
  } else {
    const Simulation own = read_simulation(input);
    if (out.empty()) out = fs::path(input).replace_extension(".html");
    body << "<h1>weft report</h1>\n<p class=\"sub\">simulation " << esc(input.string());
    if (own.j.contains("config")) body << " of " << esc(own.j.value("config", ""));
    if (own.j.contains("cluster")) body << " on " << esc(own.j.value("cluster", ""));
    body << "</p>\n" << simulation_section(own);
    std::vector<const Timeline*> list = {&own.timeline};
    if (sim) list.push_back(&sim->timeline);
    body << timelines(list);
  }
  std::ofstream f(out, std::ios::trunc);
  WEFT_CHECK(f, out.string(), ": cannot open the report for writing");
  f << page("weft report — " + input.filename().string(), body.str());
  WEFT_CHECK(f.flush(), out.string(), ": writing the report failed");
  std::printf("wrote %s\n", out.string().c_str());
  return 0;
}

}  // namespace

std::function<int()> add_report(CLI::App& app) {
  auto args = std::make_shared<ReportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "report",
      "a self-contained HTML report of a run directory (loss, throughput, microbatch balance, "
      "pipeline timeline) or of a `weft simulate --trace` JSON");
  cmd->add_option("input", args->input, "run directory, or the JSON `weft simulate` printed")
      ->required();
  cmd->add_option("--sim", args->sim,
                  "a `weft simulate --trace` JSON whose predicted timeline is drawn under the "
                  "measured one");
  cmd->add_option("--out", args->out,
                  "HTML file to write (default: RUN_DIR/report.html, or SIM.html next to the "
                  "simulation JSON)");
  return [cmd, args]() -> int {
    if (*cmd) return run_report(*args);
    return 1;
  };
}

}  // namespace weft::cli
