//! Open a container once and time many prefills of the same prompt (fresh
//! session each), for profiling a short prefill without the open in the
//! samples: `cargo run --release -p waste-model --example prefill_loop --
//! MODEL USAGE PROMPT_LEN ROUNDS [BUDGET_GIB]`. Prints each round's
//! wall-clock window (`round R START END`, seconds) so that
//! `tools/bench/profile_rounds.py` can split a `perf record -k realtime`
//! profile by round.
use std::time::Instant;
use waste_model::{Model, ModelOptions};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: prefill_loop MODEL USAGE PROMPT_LEN ROUNDS [BUDGET_GIB]");
        std::process::exit(2);
    }
    let (model, usage) = (&a[1], &a[2]);
    let plen: u32 = a[3].parse::<u32>().unwrap().max(1);
    let rounds: usize = a[4].parse::<usize>().unwrap().max(1);
    let budget: u64 = a.get(5).map(|s| s.parse().unwrap()).unwrap_or(20) << 30;
    // WASTE_NUMERIC=exact|fast when set (the engine reads it: no mode in
    // the options), else exact
    let base =
        if std::env::var_os("WASTE_NUMERIC").is_some() { ModelOptions::default() } else { ModelOptions::exact() };
    let opts = ModelOptions { usage: Some(usage.into()), budget, ..base };
    let m = Model::open(model, opts).unwrap();
    let ids: Vec<u32> = (1..=plen).collect();
    let mut t = vec![];
    // wall-clock seconds, as `perf record -k realtime` stamps its samples
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    for r in 0..rounds {
        let mut s = m.session();
        let (w0, t0) = (now(), Instant::now());
        s.eval(&ids).unwrap();
        t.push(t0.elapsed().as_secs_f64() * 1e3 / plen as f64);
        let st = s.stats();
        println!(
            "round {r} {w0:.6} {:.6}  {:.2} ms/token: experts {:.2} attention {:.2} trunk {:.2}",
            now(),
            t[r],
            st.expert_seconds * 1e3 / plen as f64,
            st.attn_seconds * 1e3 / plen as f64,
            st.trunk_seconds * 1e3 / plen as f64
        );
    }
    let first = t[0];
    t.sort_by(f64::total_cmp);
    println!("first prefill {first:.2} ms/token");
    println!("prefill {plen} ids: median {:.2} ms/token ({:.2}–{:.2})", t[t.len() / 2], t[0], t[t.len() - 1]);
}
