//! The per-key series of `/metrics`, labelled `key` with the key's name (names are checked to
//! be letters, digits, `-`, `_` and `.`, so they need no escaping). Only keys that have called
//! appear; a key removed from the file keeps its counters until the router restarts, as
//! Prometheus expects of counters.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::limiter::{KeyCounters, KeyUsage, LimitKind};

struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    value: fn(&KeyCounters) -> &AtomicU64,
}

const FAMILIES: [Family; 3] = [
    Family {
        name: "quiver_key_requests_total",
        kind: "counter",
        help: "Requests each API key made that its limits admitted.",
        value: |c| &c.requests,
    },
    Family {
        name: "quiver_key_prompt_tokens_total",
        kind: "counter",
        help: "Prompt tokens charged to each API key (counted when its request ends).",
        value: |c| &c.prompt_tokens,
    },
    Family {
        name: "quiver_key_generated_tokens_total",
        kind: "counter",
        help: "Generated tokens charged to each API key (counted when its request ends).",
        value: |c| &c.generated_tokens,
    },
];

const LIMITS: [LimitKind; 3] = [
    LimitKind::ConcurrentRequests,
    LimitKind::RequestsPerMinute,
    LimitKind::TokensPerMinute,
];

pub fn render(usage: &BTreeMap<String, Arc<KeyUsage>>, out: &mut String) {
    if usage.is_empty() {
        return;
    }
    for family in &FAMILIES {
        header(out, family.name, family.kind, family.help);
        for (key, usage) in usage {
            let value = (family.value)(&usage.counters).load(Ordering::Relaxed);
            let _ = writeln!(out, "{}{{key=\"{key}\"}} {value}", family.name);
        }
    }
    let name = "quiver_key_requests_refused_total";
    header(
        out,
        name,
        "counter",
        "Requests refused with 429 by a limit of their API key, by limit.",
    );
    for (key, usage) in usage {
        for limit in LIMITS {
            let value = usage.counters.refused(limit).load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}{{key=\"{key}\",limit=\"{}\"}} {value}",
                limit.name()
            );
        }
    }
    let name = "quiver_key_requests_running";
    header(
        out,
        name,
        "gauge",
        "Requests of each API key admitted and not finished.",
    );
    for (key, usage) in usage {
        let _ = writeln!(out, "{name}{{key=\"{key}\"}} {}", usage.in_flight());
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::tenants::KeyLimits;

    #[test]
    fn renders_one_sample_per_key_and_limit() {
        let team = Arc::new(KeyUsage::default());
        let limits = KeyLimits {
            max_concurrent_requests: Some(1),
            ..KeyLimits::default()
        };
        let held = team.admit(&limits, Instant::now()).unwrap();
        assert!(team.admit(&limits, Instant::now()).is_err());
        team.charge(7, 5, Instant::now());
        let usage = BTreeMap::from([
            ("team-a".to_owned(), team),
            ("ops".to_owned(), Arc::default()),
        ]);
        let mut out = String::new();
        render(&usage, &mut out);
        for line in [
            "quiver_key_requests_total{key=\"team-a\"} 1",
            "quiver_key_requests_total{key=\"ops\"} 0",
            "quiver_key_prompt_tokens_total{key=\"team-a\"} 7",
            "quiver_key_generated_tokens_total{key=\"team-a\"} 5",
            "quiver_key_requests_refused_total{key=\"team-a\",limit=\"max_concurrent_requests\"} 1",
            "quiver_key_requests_running{key=\"team-a\"} 1",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing from\n{out}");
        }
        drop(held);
    }

    #[test]
    fn nothing_without_keys() {
        let mut out = String::new();
        render(&BTreeMap::new(), &mut out);
        assert!(out.is_empty());
    }
}
