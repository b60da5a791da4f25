#include "client/report/decision.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/report/svg.h"

namespace kvcal::report {
namespace {

// The member `key` of `object` when it is of the wanted kind, else null.
const Json* Field(const Json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

std::string Str(const Json& object, const char* key) {
  const Json* f = Field(object, key);
  return f && f->is_string() ? f->get<std::string>() : std::string();
}

double Num(const Json& object, const char* key) {
  const Json* f = Field(object, key);
  return f && f->is_number() ? f->get<double>()
                             : std::numeric_limits<double>::quiet_NaN();
}

bool Bool(const Json& object, const char* key) {
  const Json* f = Field(object, key);
  return f && f->is_boolean() && f->get<bool>();
}

// "+0.0123 ± 0.0045" (or "—" for a figure that was not measured).
std::string DeltaText(double delta, double se) {
  if (std::isnan(delta)) return "&#8212;";
  if (std::isnan(se)) return absl::StrFormat("%+.4f", delta);
  return absl::StrFormat("%+.4f &#177; %.4f", delta, se);
}

std::string LayersText(const Json* layers) {
  std::vector<std::string> out;
  if (layers && layers->is_array()) {
    for (const Json& l : *layers) {
      if (l.is_number_integer()) out.push_back(std::to_string(l.get<int>()));
    }
  }
  return absl::StrJoin(out, " ");
}

absl::Status Missing(const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("the decision has no ", what,
                   " (write it with kvcal-calibrate; kvcal report --decision "
                   "renders kvcal-calibrate's decision JSON)"));
}

}  // namespace

absl::StatusOr<Recommendation> RecommendFromDecision(
    const Json& view, const std::vector<EvaluationRow>& evaluations) {
  const Json* d = Field(view, "decision");
  if (!d || !d->is_object()) return Missing("\"decision\" object");
  for (const char* key : {"scales", "granularity", "kv_cache_dtype", "why"}) {
    if (Str(*d, key).empty()) return Missing(absl::StrCat("decision.", key));
  }
  const Json* serve = Field(*d, "serve");
  if (!serve || Str(*serve, "command").empty()) {
    return Missing("decision.serve.command");
  }
  const Json* candidates = Field(view, "candidates");
  if (!candidates || !candidates->is_array() || candidates->empty()) {
    return Missing("\"candidates\" list");
  }
  Recommendation rec;
  const std::string label = Str(*d, "scales");
  const Json* observer = Field(*d, "observer");
  const bool kv_only = Bool(*d, "kv_only");
  rec.json = {
      {"basis", "kvcal-calibrate"},
      {"label", label},
      {"observer", observer && observer->is_string()
                       ? observer->get<std::string>()
                       : std::string("scale_one")},
      {"granularity", Str(*d, "granularity") == "one" ? std::string("tensor")
                                                      : Str(*d, "granularity")},
      {"quantize", kv_only ? "k_v" : "q_k_v"},
      {"margin", 1.0},
      {"kv_cache_dtype", Str(*d, "kv_cache_dtype")},
      {"skip_layers",
       Field(*d, "skip_layers") ? *Field(*d, "skip_layers") : Json::array()},
      {"serve", Str(*serve, "command")},
  };
  rec.reason = Str(*d, "why");
  for (const EvaluationRow& r : evaluations) {
    if (r.kv_format == "fp8" && r.label == label) rec.row = &r;
  }
  return rec;
}

std::string DecisionServeSection(const Json& view) {
  const Json& d = view["decision"];
  const Json& serve = d["serve"];
  std::string body = "<section id=\"recommendation\"><h2>Recommendation</h2>";
  const std::string dtype = Str(d, "kv_cache_dtype");
  const std::string skip = LayersText(Field(d, "skip_layers"));
  absl::StrAppendFormat(
      &body,
      "<p class=\"rec\">Scales: <b>%s</b>. KV cache: <b>%s</b>%s.</p>"
      "<p>Chosen because %s.</p><p>Serve it with:</p><pre><code "
      "id=\"serve-command\">%s</code></pre>",
      Escape(Str(d, "scales")), Escape(dtype),
      skip.empty() ? "" : absl::StrCat(", layers ", skip, " unquantized"),
      Escape(Str(d, "why")), Escape(Str(serve, "command")));
  if (const Json* alt = Field(serve, "fp8_alternative");
      alt && alt->is_object()) {
    absl::StrAppendFormat(&body,
                          "<p>Or, accepting FP8's cost (%s):</p><pre><code "
                          "id=\"fp8-command\">%s</code></pre>",
                          Escape(Str(*alt, "cost")),
                          Escape(Str(*alt, "command")));
  }
  if (const Json* notes = Field(serve, "notes"); notes && notes->is_array()) {
    for (const Json& n : *notes) {
      if (n.is_string()) {
        absl::StrAppend(&body, "<p>", Escape(n.get<std::string>()), "</p>");
      }
    }
  }
  if (const Json* noise = Field(d, "noise")) {
    if (const Json* lines = Field(*noise, "lines");
        lines && lines->is_array()) {
      for (const Json& l : *lines) {
        if (!l.is_string()) continue;
        absl::StrAppend(&body, "<p class=\"",
                        Bool(*noise, "resolved") ? "noise" : "noise note",
                        "\">", Escape(l.get<std::string>()), "</p>");
      }
    }
  }
  body += "</section>";
  return body;
}

std::string DecisionCandidatesSection(const Json& view) {
  std::string body =
      "<section id=\"candidates\"><h2>Candidates (kvcal-calibrate)</h2>";
  absl::StrAppendFormat(
      &body,
      "<p>Every setting scored on the held-out windows (%d tokens; "
      "unquantized loss %.4f nats/token): &#916; nats/token against the "
      "unquantized model &#177; standard error, mean attention error. The "
      "chosen one is marked.</p><table id=\"candidates-table\"><tr>"
      "<th>candidate</th><th>&#916; nats/token</th><th>attention error</th>"
      "<th>chosen</th><th>note</th></tr>",
      static_cast<int>(Num(view, "holdout_tokens")),
      Num(view, "reference_nll"));
  for (const Json& c : view["candidates"]) {
    const bool chosen = Bool(c, "chosen");
    std::string note = Str(c, "note");
    if (!Str(c, "same_as").empty()) {
      note = absl::StrCat("same as ", Str(c, "same_as"));
    } else if (Bool(c, "best")) {
      note = note.empty() ? "lowest loss" : absl::StrCat("lowest loss; ", note);
    }
    absl::StrAppendFormat(
        &body,
        "<tr%s><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td></tr>",
        chosen ? " class=\"chosen\"" : "", Escape(Str(c, "label")),
        DeltaText(Num(c, "delta_nll"), Num(c, "delta_nll_se")),
        std::isnan(Num(c, "attention_error_mean"))
            ? std::string("&#8212;")
            : Percent(Num(c, "attention_error_mean")),
        chosen ? "&#10003;" : "", Escape(note));
  }
  body += "</table></section>";
  return body;
}

std::string DecisionFormatsSection(const Json& view) {
  std::string body =
      "<section id=\"skip-layers\"><h2>Layers to leave unquantized</h2>";
  const Json* skip = Field(view, "skip_layers");
  if (skip && skip->is_object()) {
    const std::string layers = LayersText(Field(*skip, "layers"));
    absl::StrAppendFormat(
        &body, "<p>%s: %s (%s).</p>", Escape(Str(*skip, "kv_format")),
        layers.empty() ? std::string("none advised")
                       : absl::StrCat("layers ", layers, " (",
                                      Escape(Str(*skip, "argument")), ")"),
        Escape(Str(*skip, "reason")));
  } else {
    body += "<p>Not measured.</p>";
  }
  body += "</section><section id=\"cache-format\"><h2>Cache format</h2>";
  const Json* formats = Field(view, "cache_formats");
  const Json& d = view["decision"];
  if (!formats || !formats->is_object()) {
    absl::StrAppendFormat(&body, "<p>Not compared; served as %s.</p>",
                          Escape(Str(d, "kv_cache_dtype")));
    return body + "</section>";
  }
  absl::StrAppendFormat(
      &body,
      "<p>Each format's held-out &#916; nats/token with its advised skip "
      "layers; a format is within the tolerance when &#916; &#8804; %g. The "
      "recommendation is the fewest cache bytes within it, else the model's "
      "16-bit dtype: here <b>%s</b>.</p><table id=\"formats-table\"><tr>"
      "<th>format</th><th>scales</th><th>&#916; nats/token</th>"
      "<th>skip layers</th><th>cache bytes vs 16-bit</th><th>within</th>"
      "</tr>",
      Num(*formats, "tolerance_nats_per_token"),
      Escape(Str(d, "kv_cache_dtype")));
  if (const Json* rows = Field(*formats, "formats"); rows && rows->is_array()) {
    for (const Json& f : *rows) {
      const bool served = Str(f, "kv_format") == Str(d, "kv_cache_dtype");
      absl::StrAppendFormat(
          &body,
          "<tr%s><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>x%.3f</td>"
          "<td>%s</td></tr>",
          served ? " class=\"chosen\"" : "", Escape(Str(f, "kv_format")),
          Escape(Str(f, "scales")),
          DeltaText(Num(f, "best_delta_nll"), Num(f, "best_delta_nll_se")),
          LayersText(Field(f, "skip_layers")), Num(f, "cache_bytes_ratio"),
          Bool(f, "within_tolerance") ? "yes" : "no");
    }
  }
  body += "</table></section>";
  return body;
}

}  // namespace kvcal::report
