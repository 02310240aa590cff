//! Per-request latencies and lengths, by adapter label: time to first token, inter-token
//! latency, end-to-end time, prompt and generated tokens. A `RequestTimer` finds its adapter's
//! series once, when the request is submitted; each token then costs a clock read and a few
//! atomic adds.

use std::sync::Arc;
use std::time::Instant;

use super::histogram::{self, Histogram};
use super::labels::{AdapterLabels, Family};
use super::text;

/// The histograms of one adapter label.
#[derive(Debug)]
pub struct RequestSeries {
    first_token: Histogram,
    inter_token: Histogram,
    end_to_end: Histogram,
    prompt_tokens: Histogram,
    generated_tokens: Histogram,
}

impl RequestSeries {
    fn new() -> Self {
        Self {
            first_token: Histogram::new(histogram::LATENCY_SECONDS),
            inter_token: Histogram::new(histogram::LATENCY_SECONDS),
            end_to_end: Histogram::new(histogram::LATENCY_SECONDS),
            prompt_tokens: Histogram::new(histogram::TOKENS),
            generated_tokens: Histogram::new(histogram::TOKENS),
        }
    }
}

#[derive(Debug)]
pub struct RequestMetrics {
    labels: Arc<AdapterLabels>,
    series: Family<RequestSeries>,
}

impl RequestMetrics {
    pub fn new(labels: Arc<AdapterLabels>) -> Self {
        Self {
            labels,
            series: Family::new(RequestSeries::new),
        }
    }

    /// Starts timing one request (one choice) on `adapter_id`, submitted now.
    pub fn start(&self, adapter_id: &str, prompt_tokens: usize) -> RequestTimer {
        let label = self.labels.label(adapter_id);
        let now = Instant::now();
        RequestTimer {
            series: self.series.get(&label),
            submitted: now,
            last_token: None,
            prompt_tokens,
        }
    }

    pub fn render(&self, out: &mut String) {
        type Pick = fn(&RequestSeries) -> &Histogram;
        let families: [(&str, &str, Pick); 5] = [
            (
                "quiver_request_time_to_first_token_seconds",
                "Time from submission to the scheduler to the first generated token.",
                |s| &s.first_token,
            ),
            (
                "quiver_request_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request.",
                |s| &s.inter_token,
            ),
            (
                "quiver_request_duration_seconds",
                "Time from submission to the scheduler to the last token, for requests that \
                 finished.",
                |s| &s.end_to_end,
            ),
            (
                "quiver_request_prompt_tokens",
                "Prompt length in tokens, for requests that finished.",
                |s| &s.prompt_tokens,
            ),
            (
                "quiver_request_generation_tokens",
                "Generated tokens, for requests that finished.",
                |s| &s.generated_tokens,
            ),
        ];
        let children = self.series.snapshot();
        for (name, help, pick) in families {
            text::header(out, name, "histogram", help);
            for (label, series) in &children {
                pick(series).render(out, name, &[("adapter", label)]);
            }
        }
    }
}

/// The clock of one request; dropped without `finished` (failed, client gone), it only leaves
/// the tokens it saw counted.
#[derive(Debug)]
pub struct RequestTimer {
    series: Arc<RequestSeries>,
    submitted: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
}

impl RequestTimer {
    /// A token was generated.
    pub fn token(&mut self) {
        let now = Instant::now();
        match self.last_token {
            None => self
                .series
                .first_token
                .observe((now - self.submitted).as_secs_f64()),
            Some(last) => self.series.inter_token.observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
    }

    /// The request ended normally after `generated` tokens.
    pub fn finished(&self, generated: u32) {
        let series = &self.series;
        series
            .end_to_end
            .observe(self.submitted.elapsed().as_secs_f64());
        series.prompt_tokens.observe(self.prompt_tokens as f64);
        series.generated_tokens.observe(f64::from(generated));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_of_three_tokens_has_one_first_token_and_two_gaps() {
        let metrics = RequestMetrics::new(Arc::new(AdapterLabels::new("base-model", 1)));
        let mut timer = metrics.start("", 5);
        (0..3).for_each(|_| timer.token());
        timer.finished(3);
        let mut out = String::new();
        metrics.render(&mut out);
        let label = "{adapter=\"base-model\"}";
        for (name, count) in [
            ("quiver_request_time_to_first_token_seconds", 1),
            ("quiver_request_inter_token_latency_seconds", 2),
            ("quiver_request_duration_seconds", 1),
            ("quiver_request_generation_tokens", 1),
        ] {
            assert!(
                out.contains(&format!("{name}_count{label} {count}\n")),
                "{name}"
            );
        }
        assert!(out.contains(&format!("quiver_request_prompt_tokens_sum{label} 5\n")));
        assert!(out.contains(&format!("quiver_request_generation_tokens_sum{label} 3\n")));
    }
}
