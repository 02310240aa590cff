//! A Prometheus histogram in atomics: observing is a few relaxed atomic adds, no lock, so it
//! can sit on the per-token path. Buckets are fixed at construction.

use std::sync::atomic::{AtomicU64, Ordering};

use super::text;

/// Upper bounds for latencies in seconds: 1 ms to 5 min.
pub const LATENCY_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
];

/// Upper bounds for token counts: 1 to 128k, roughly doubling.
pub const TOKENS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    32768.0, 65536.0, 131072.0,
];

/// Upper bounds for requests in one batch.
pub const BATCH_SIZE: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    /// The sum's f64 bits, updated by compare-and-swap.
    sum_bits: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, value: f64) {
        let index = self.bounds.partition_point(|&bound| bound < value);
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum_bits.load(Ordering::Relaxed))
    }

    /// The `_bucket`, `_sum` and `_count` samples, with `labels` before `le`. The count written
    /// is the buckets' total, so `+Inf` and `_count` always agree within one scrape.
    pub fn render(&self, out: &mut String, name: &str, labels: &[(&str, &str)]) {
        let bucket_name = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (index, bucket) in self.buckets.iter().enumerate() {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = match self.bounds.get(index) {
                Some(bound) => format!("{bound:?}"),
                None => "+Inf".to_owned(),
            };
            let mut with_le = labels.to_vec();
            with_le.push(("le", le.as_str()));
            text::sample(out, &bucket_name, &with_le, cumulative);
        }
        text::sample(out, &format!("{name}_sum"), labels, self.sum());
        text::sample(out, &format!("{name}_count"), labels, cumulative);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_upper_bounds_inclusive() {
        let histogram = Histogram::new(&[1.0, 2.0]);
        for value in [0.5, 1.0, 1.5, 3.0] {
            histogram.observe(value);
        }
        let mut out = String::new();
        histogram.render(&mut out, "h", &[("adapter", "a")]);
        assert_eq!(
            out,
            "h_bucket{adapter=\"a\",le=\"1.0\"} 2\n\
             h_bucket{adapter=\"a\",le=\"2.0\"} 3\n\
             h_bucket{adapter=\"a\",le=\"+Inf\"} 4\n\
             h_sum{adapter=\"a\"} 6\n\
             h_count{adapter=\"a\"} 4\n"
        );
    }

    #[test]
    fn observations_from_many_threads_all_count() {
        let histogram = std::sync::Arc::new(Histogram::new(LATENCY_SECONDS));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let histogram = histogram.clone();
                std::thread::spawn(move || (0..1000).for_each(|_| histogram.observe(0.5)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(histogram.count(), 4000);
        assert_eq!(histogram.sum(), 2000.0);
    }
}
