//! Lock-free latency histograms: every delivery records into them without a lock, and readers
//! (benchmarks, the admin endpoint) take quantiles. Buckets are quarter-octaves from 1 µs to
//! about 70 s, so a quantile is exact to within ±9%.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const BUCKETS: usize = 4 * 26 + 1;

pub struct LatencyHistogram {
    counts: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

/// Upper bound, in microseconds, of bucket `i`: 2^(i/4).
fn upper_us(i: usize) -> f64 {
    2f64.powf(i as f64 / 4.0)
}

impl LatencyHistogram {
    pub fn record(&self, d: Duration) {
        let us = d.as_secs_f64() * 1e6;
        let i = if us <= 1.0 {
            0
        } else {
            ((us.log2() * 4.0).ceil() as usize).min(BUCKETS - 1)
        };
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    pub fn mean(&self) -> Option<Duration> {
        let n = self.count();
        (n > 0).then(|| Duration::from_nanos(self.sum_ns.load(Ordering::Relaxed) / n))
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1); `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let counts: Vec<u64> = self
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Duration::from_secs_f64(upper_us(i) / 1e6));
            }
        }
        None
    }

    /// Counts per octave from `from` up, as a Prometheus histogram's buckets (upper bound in
    /// seconds, count in that bucket alone — lower buckets fold into the first, the last is
    /// `+Inf`), with the sum in seconds and the total count.
    pub fn octaves(&self, from: Duration) -> (f64, u64, Vec<(f64, u64)>) {
        let from_us = from.as_secs_f64() * 1e6;
        let (mut buckets, mut pending, mut total) = (Vec::new(), 0, 0);
        for (i, c) in self.counts.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            pending += n;
            total += n;
            // The last bucket also holds everything longer: it is the `+Inf` one.
            if i % 4 == 0 && i < BUCKETS - 1 && upper_us(i) >= from_us {
                buckets.push((upper_us(i) / 1e6, std::mem::take(&mut pending)));
            }
        }
        buckets.push((f64::INFINITY, pending));
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (sum, total, buckets)
    }

    pub fn reset(&self) {
        for c in &self.counts {
            c.store(0, Ordering::Relaxed);
        }
        self.sum_ns.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_fall_within_a_quarter_octave() {
        let h = LatencyHistogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 1000);
        let p50 = h.quantile(0.5).unwrap().as_secs_f64() * 1e6;
        assert!((500.0..=500.0 * 1.19).contains(&p50), "p50 {p50}");
        let p99 = h.quantile(0.99).unwrap().as_secs_f64() * 1e6;
        assert!((990.0..=990.0 * 1.19).contains(&p99), "p99 {p99}");
        assert!(LatencyHistogram::default().quantile(0.5).is_none());
    }

    #[test]
    fn octaves_count_each_bucket_once() {
        let h = LatencyHistogram::default();
        h.record(Duration::from_micros(10));
        h.record(Duration::from_micros(100));
        h.record(Duration::from_millis(3));
        h.record(Duration::from_millis(3));
        h.record(Duration::from_secs(100));
        let (sum, count, buckets) = h.octaves(Duration::from_micros(64));
        assert_eq!(count, 5);
        assert!((sum - 100.00611).abs() < 1e-9, "{sum}");
        assert_eq!(buckets.first(), Some(&(64e-6, 1)));
        assert_eq!(buckets.iter().map(|b| b.1).sum::<u64>(), 5);
        let at = |le: f64| buckets.iter().find(|b| b.0 == le).map(|b| b.1);
        assert_eq!(at(128e-6), Some(1));
        assert_eq!(at(4096e-6), Some(2));
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, 1)));
    }
}
