//! `waste convert`.

use crate::print_json;
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use waste_convert::{convert as run_convert, ConvertOptions, HeadMode, Progress, TrunkMode, VisionMode};

#[derive(Args)]
pub struct ConvertArgs {
    /// Hugging Face-style model directory (config.json, *.safetensors, tokenizer files).
    #[arg(long)]
    src: PathBuf,
    /// Output container directory.
    #[arg(long)]
    out: PathBuf,
    /// Expert format: vq3r, vq4p, vq2r, q4g (4-bit groups: the fastest compute, for models that fit in RAM), f16, bf16.
    #[arg(long, default_value = "vq3r")]
    experts: String,
    /// Trunk format: q4, q8, f16, f32.
    #[arg(long, default_value = "q4")]
    trunk: String,
    /// The output head's format: q8 (8-bit groups, as the q4 and q8 trunks
    /// store it) or q4 (4-bit groups: half the bytes, the largest matrix a
    /// token reads, for a little accuracy). Unset, it follows --trunk.
    #[arg(long)]
    head: Option<String>,
    /// K3's vision tower (when the source has one): q8 (default; the C WASTE
    /// reads it) or f16 (this engine only).
    #[arg(long, default_value = "q8", conflicts_with = "no_vision")]
    vision: String,
    /// Leave the vision tower out (a text-only container).
    #[arg(long)]
    no_vision: bool,
    /// Convert only the MoE layers A-B (inclusive) in this run.
    #[arg(long)]
    layers: Option<String>,
    /// Encoder threads, 1 to 256 (0 = all cores).
    #[arg(long, default_value_t = 0)]
    jobs: usize,
    /// Seed (same seed, same container).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Experts sampled per layer to fit the codebooks.
    #[arg(long, default_value_t = 8)]
    cb_sample: usize,
    /// Discard an unfinished conversion made with other options and start over
    /// (only the `OUT.partial` folder this command made; `--out` itself is
    /// never overwritten).
    #[arg(long)]
    force: bool,
    /// Machine-readable report.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

pub fn convert(a: ConvertArgs) -> Result<ExitCode> {
    let experts = waste_model::format::ExpertQuant::parse_fmt(&a.experts)
        .with_context(|| format!("--experts {:?}: expected vq3r, vq4p, vq2r, q4g, f16 or bf16", a.experts))?;
    let trunk =
        TrunkMode::parse(&a.trunk).with_context(|| format!("--trunk {:?}: expected q4, q8, f16 or f32", a.trunk))?;
    let head = match &a.head {
        None => None,
        Some(h) => Some(HeadMode::parse(h).with_context(|| format!("--head {h:?}: expected q8 or q4"))?),
    };
    let vision = if a.no_vision {
        VisionMode::Off
    } else {
        VisionMode::parse(&a.vision).with_context(|| format!("--vision {:?}: expected q8 or f16", a.vision))?
    };
    let layers = match &a.layers {
        None => None,
        Some(s) => {
            let (x, y) = s.split_once('-').unwrap_or((s, s));
            Some((
                x.trim().parse().with_context(|| format!("--layers {s:?}: expected A-B"))?,
                y.trim().parse().with_context(|| format!("--layers {s:?}: expected A-B"))?,
            ))
        }
    };
    let jobs = match a.jobs {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()).min(waste_convert::MAX_JOBS),
        j => j,
    };
    let o = ConvertOptions {
        experts,
        trunk,
        head,
        layers,
        jobs,
        seed: a.seed,
        cb_sample: a.cb_sample,
        force: a.force,
        vision,
        ..Default::default()
    };
    let bar =
        if a.quiet || a.json || !std::io::stderr().is_terminal() { ProgressBar::hidden() } else { ProgressBar::new(0) };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let rep = run_convert(&a.src, &a.out, &o, &|p| match p {
        Progress::Trunk { done, total } => {
            bar.set_message("trunk");
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        }
        Progress::Experts { done, total } => {
            bar.set_message("experts");
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        }
    })
    .with_context(|| format!("converting {} into {}", a.src.display(), a.out.display()))?;
    bar.finish_and_clear();
    if let Some(names) = rep.unused_tensors.as_ref().filter(|n| !n.is_empty()) {
        let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
        eprintln!(
            "warning: {} checkpoint tensor(s) were not used, a model variant the engine may not implement: {}{}",
            names.len(),
            shown.join(", "),
            if names.len() > shown.len() { ", …" } else { "" }
        );
    }
    let per_expert = if rep.experts > 0 { rep.seconds / rep.experts as f64 } else { 0.0 };
    if a.json {
        print_json(
            &json!({"complete": rep.complete, "experts": rep.experts, "seconds": rep.seconds, "seconds_per_expert": per_expert,
            "rel_error": {"gate": rep.rel_error[0], "up": rep.rel_error[1], "down": rep.rel_error[2]},
            "per_layer": rep.per_layer.iter().map(|(l, e)| json!({"layer": l, "gate": e[0], "up": e[1], "down": e[2]})).collect::<Vec<_>>(),
            "resumed_layers": rep.resumed_layers, "staging": rep.staging, "unused_tensors": rep.unused_tensors}),
        )?;
    } else {
        outln!(
            "{} experts in {:.1} s ({:.3} s/expert); relative error gate {:.4} up {:.4} down {:.4}{}",
            rep.experts,
            rep.seconds,
            per_expert,
            rep.rel_error[0],
            rep.rel_error[1],
            rep.rel_error[2],
            match &rep.staging {
                Some(d) if !rep.complete =>
                    format!(" — incomplete ({}): run again for the remaining layers", d.display()),
                _ => String::new(),
            }
        );
        for (l, e) in &rep.per_layer {
            outln!("  layer {l:>3}: gate {:.4}  up {:.4}  down {:.4}", e[0], e[1], e[2]);
        }
    }
    Ok(ExitCode::SUCCESS)
}
