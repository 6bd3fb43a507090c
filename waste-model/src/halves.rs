//! Whether a batched step runs as one batch or as two halves in turn
//! ([`crate::ModelOptions::halves`]), chosen by the steps' measured times.
//!
//! The halves hide one half's expert reads behind the other half's
//! compute, but stream the trunk's weights once per half: they pay where
//! a step waits for the disk and cost where the cores are the bound
//! (docs/lab entry 81: +25–35 % at AVX-512 on a 6 GB 48B, −5–8 % at AVX2
//! there). Which one a machine, budget and batch are in is measured, not
//! guessed: each batch size keeps a moving average of each form's step
//! time, tries each form [`TRIES`] times first, then takes the faster and
//! tries the other every [`EXPLORE`] steps (the balance drifts with the
//! context and the cache). Either form gives the same bits; this decides
//! speed only.

/// Steps of each form a batch size runs before comparing them.
pub const TRIES: u32 = 2;
/// Every this many steps of a batch size, the slower form runs once more.
pub const EXPLORE: u64 = 16;
/// The moving average's weight of a new step.
const ALPHA: f64 = 0.3;

/// One batch size's record: per form (one batch, halves) the moving
/// average of a step's seconds and the steps measured.
#[derive(Clone, Copy, Debug, Default)]
struct Record {
    secs: [f64; 2],
    runs: [u32; 2],
    steps: u64,
}

/// The chooser: a record per batch size.
#[derive(Debug, Default)]
pub struct Choice {
    sizes: Vec<Record>,
}

impl Choice {
    /// Whether a step of `n` sequences should run as halves.
    pub fn choose(&mut self, n: usize) -> bool {
        if self.sizes.len() <= n {
            self.sizes.resize(n + 1, Record::default());
        }
        let r = &mut self.sizes[n];
        r.steps += 1;
        // each form's first tries, alternating (one batch first)
        if let Some(f) = (0..2).find(|&f| r.runs[f] < TRIES && r.runs[f] <= r.runs[1 - f]) {
            return f == 1;
        }
        let faster = usize::from(r.secs[1] < r.secs[0]);
        let form = if r.steps.is_multiple_of(EXPLORE) { 1 - faster } else { faster };
        form == 1
    }

    /// A step of `n` sequences in the form `halves` took `secs`.
    pub fn record(&mut self, n: usize, halves: bool, secs: f64) {
        if self.sizes.len() <= n || !secs.is_finite() {
            return;
        }
        let (r, f) = (&mut self.sizes[n], usize::from(halves));
        r.secs[f] = if r.runs[f] == 0 { secs } else { r.secs[f] + ALPHA * (secs - r.secs[f]) };
        r.runs[f] = r.runs[f].saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of `n` sequences whose time is `time(halves)`;
    /// returns how many ran as halves.
    fn run(c: &mut Choice, n: usize, steps: usize, time: impl Fn(bool) -> f64) -> usize {
        (0..steps)
            .filter(|_| {
                let h = c.choose(n);
                c.record(n, h, time(h));
                h
            })
            .count()
    }

    #[test]
    fn the_faster_form_wins_and_the_slower_is_still_tried() {
        // the disk the bound: halves faster
        let mut c = Choice::default();
        let h = run(&mut c, 4, 160, |h| if h { 0.36 } else { 0.47 });
        assert!((140..160).contains(&h), "halves ran {h} of 160 steps");
        // the cores the bound: one batch faster
        let mut c = Choice::default();
        let h = run(&mut c, 4, 160, |h| if h { 0.52 } else { 0.50 });
        assert!((2..=20).contains(&h), "halves ran {h} of 160 steps");
    }

    #[test]
    fn each_batch_size_keeps_its_own_record_and_follows_a_drift() {
        let mut c = Choice::default();
        // at 2 sequences one batch is faster, at 8 the halves
        run(&mut c, 2, 40, |h| if h { 0.30 } else { 0.20 });
        run(&mut c, 8, 40, |h| if h { 0.60 } else { 0.90 });
        assert!(!c.choose(2) || !c.choose(2));
        assert!(c.choose(8) || c.choose(8));
        // the balance turns (a longer context, a colder cache): the
        // explored steps find it and the choice follows
        let h = run(&mut c, 2, 200, |h| if h { 0.30 } else { 0.45 });
        assert!(h > 150, "halves ran {h} of 200 steps after the turn");
    }

    #[test]
    fn both_forms_are_tried_before_any_is_preferred() {
        let mut c = Choice::default();
        let forms: Vec<bool> = (0..4)
            .map(|_| {
                let h = c.choose(3);
                c.record(3, h, 1.0);
                h
            })
            .collect();
        assert_eq!(forms, [false, true, false, true]);
        // a non-finite time is not recorded
        c.record(3, true, f64::NAN);
        assert!(c.sizes[3].secs.iter().all(|s| s.is_finite()));
    }
}
