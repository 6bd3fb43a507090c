//! `waste info`, `waste verify`, `waste version`.

use crate::{print_json, progress::bytes_bar, EXIT_PROBLEMS};
use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use waste_model::format::Container;

#[derive(Args)]
pub struct InfoArgs {
    /// Container directory.
    model: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct VerifyArgs {
    /// Container directory.
    model: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Read through the page cache instead of direct I/O.
    #[arg(long)]
    no_direct_io: bool,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
    /// Also re-check every expert's reconstruction error against this source directory.
    #[arg(long)]
    src: Option<PathBuf>,
}

#[derive(Args)]
pub struct VersionArgs {
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn info(a: InfoArgs) -> Result<ExitCode> {
    let c = Container::open(&a.model)?;
    let cfg = &c.config;
    let p = c.param_counts();
    let kinds: String =
        cfg.attn_kinds.iter().map(|k| if *k == waste_model::format::AttnKind::Kda { 'K' } else { 'M' }).collect();
    let vision = waste_model::plan(&a.model, 1).map(|p| p.vision_bytes()).unwrap_or(0);
    let numeric = waste_model::build_info().numeric;
    let (efmt, rec) = c.experts.as_ref().map(|(q, l)| (q.fmt.name(), l.rec_bytes)).unwrap_or(("none", 0));
    let v = json!({
        "path": a.model.display().to_string(),
        "arch": c.manifest.arch,
        // the architecture family whose module reads this config (waste_format::arch)
        "family": cfg.family.def().name,
        "format_version": c.manifest.format_version,
        "layers": cfg.layers,
        "moe_layers": cfg.n_moe_layers(),
        "attention": kinds,
        "hidden": cfg.hidden,
        "vocab": cfg.vocab,
        "experts": cfg.experts,
        "top_k": cfg.top_k,
        "shared_experts": cfg.shared_experts,
        "moe_intermediate": cfg.moe_intermediate,
        "expert_width": cfg.expert_width(),
        "params_total": p.total,
        "params_active": p.active,
        "expert_format": efmt,
        "expert_record_bytes": rec,
        "trunk_resident_bytes": c.resident_trunk_bytes(),
        "trunk_file_bytes": c.trunk_len,
        "quantization": c.quant_summary(),
        // K3's vision tower: what enabling images adds (0 = no tower)
        "vision_bytes": vision,
        // what a run here computes in without --exact / --fast
        "numeric_mode": numeric,
    });
    if a.json {
        print_json(&v)?;
    } else {
        outln!("{}  ({}; family {})", a.model.display(), c.manifest.arch, cfg.family.def().name);
        outln!("  layers {} ({} MoE), attention {kinds}", cfg.layers, cfg.n_moe_layers());
        outln!(
            "  hidden {}, vocab {}, experts {} top-{} (+{} shared), expert width {}",
            cfg.hidden,
            cfg.vocab,
            cfg.experts,
            cfg.top_k,
            cfg.shared_experts,
            cfg.expert_width()
        );
        outln!("  parameters: {} total, {} active per token", group(p.total), group(p.active));
        outln!("  expert record {} bytes; resident trunk {} bytes", group(rec as u64), group(c.resident_trunk_bytes()));
        outln!("  quantization: {}", c.quant_summary());
        if vision > 0 {
            outln!("  vision tower: yes (images add {} bytes: --image, serve)", group(vision));
        }
        outln!("  numeric mode on this machine: {numeric} (--exact / --fast choose)");
    }
    Ok(ExitCode::SUCCESS)
}

fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

pub fn verify(a: VerifyArgs) -> Result<ExitCode> {
    // nothing there, a file, a folder without a manifest: an error (exit 1),
    // not damage found (exit 3)
    if !a.model.exists() {
        bail!("{}: nothing there (no such file or folder)", a.model.display());
    }
    if !a.model.join("manifest.json").is_file() {
        waste_model::format::Container::open(&a.model)?;
    }
    let bar = bytes_bar("verify", a.quiet || a.json);
    let opts = waste_model::VerifyOptions { direct_io: !a.no_direct_io, ..Default::default() };
    let res = waste_model::verify(&a.model, opts, &|d, t| {
        bar.set_length(t);
        bar.set_position(d);
    });
    bar.finish_and_clear();
    let (problems, rep) = match res {
        Ok(r) => (r.problems.clone(), Some(r)),
        Err(e) => (vec![e.to_string()], None),
    };
    if a.json {
        let r = rep.clone().unwrap_or_default();
        print_json(
            &json!({"ok": problems.is_empty(), "problems": problems, "records": r.records, "tensors": r.tensors, "bytes": r.bytes,
            "seconds": r.seconds, "gbps": if r.seconds > 0.0 { r.bytes as f64 / r.seconds / 1e9 } else { 0.0 }, "direct_io": r.direct_io}),
        )?;
    } else {
        for p in &problems {
            eprintln!("{p}");
        }
        if let Some(r) = &rep {
            let gbps = if r.seconds > 0.0 { r.bytes as f64 / r.seconds / 1e9 } else { 0.0 };
            outln!(
                "{}: {} tensors, {} records, {} bytes in {:.2} s ({gbps:.2} GB/s, direct I/O {}): {}",
                a.model.display(),
                r.tensors,
                r.records,
                r.bytes,
                r.seconds,
                if r.direct_io { "yes" } else { "no" },
                if problems.is_empty() { "OK".to_string() } else { format!("{} problem(s)", problems.len()) }
            );
        }
    }
    if let (Some(src), true) = (&a.src, problems.is_empty()) {
        let r = waste_convert::verify_against_source(&a.model, src)?;
        if a.json {
            print_json(
                &json!({"source": src.display().to_string(), "experts": r.experts, "rel_error": {"gate": r.rel_error[0], "up": r.rel_error[1], "down": r.rel_error[2]}}),
            )?;
        } else {
            outln!(
                "against {}: {} experts, relative error gate {:.4} up {:.4} down {:.4}",
                src.display(),
                r.experts,
                r.rel_error[0],
                r.rel_error[1],
                r.rel_error[2]
            );
        }
    }
    Ok(if problems.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(EXIT_PROBLEMS) })
}

pub fn version(a: VersionArgs) -> Result<ExitCode> {
    let b = waste_model::build_info();
    if a.json {
        print_json(&json!({"version": b.version, "simd": b.simd, "simd_available": b.simd_available,
                    "format_version": b.format_version, "numeric_mode": b.numeric, "avx_vnni": b.avx_vnni}))?;
    } else {
        outln!(
            "waste {} (simd {}{}; available: {}; numeric mode {}; container format v{})",
            b.version,
            b.simd,
            if b.avx_vnni { " with AVX-VNNI" } else { "" },
            b.simd_available.join(", "),
            b.numeric,
            b.format_version
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct DiskbenchArgs {
    /// A large file on the disk to measure (e.g. an expert bank).
    file: PathBuf,
    /// Bytes per read, e.g. 1M (rounded up to 4 KiB; at most 1 GiB across the reads in flight).
    #[arg(long, default_value = "1M", value_parser = crate::cmd_eval::parse_bytes_usize)]
    record_size: usize,
    /// Reads in flight (one reader thread each, 1 to 64).
    #[arg(long, default_value_t = 4)]
    qd: usize,
    /// Stop after this many bytes, e.g. 4G.
    #[arg(long, default_value = "4G", value_parser = crate::cmd_eval::parse_bytes)]
    max_bytes: u64,
    /// Use the page cache.
    #[arg(long)]
    no_direct_io: bool,
    /// Use 4 KiB pages instead of 2 MiB huge pages for the buffers.
    #[arg(long)]
    no_huge: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn diskbench(a: DiskbenchArgs) -> Result<ExitCode> {
    let r = waste_model::io::probe_bandwidth(&a.file, a.record_size, a.qd, a.max_bytes, !a.no_direct_io, !a.no_huge)?;
    if a.json {
        print_json(
            &json!({"gbps": r.gbps, "bytes": r.bytes, "seconds": r.seconds, "direct_io": r.direct, "huge_pages": r.huge, "record_size": r.record, "qd": r.qd}),
        )?;
    } else {
        outln!(
            "{:.3} GB/s ({} bytes in {:.2} s; record {} B, qd {}, direct I/O {}, huge pages {})",
            r.gbps,
            r.bytes,
            r.seconds,
            r.record,
            r.qd,
            r.direct,
            r.huge
        );
    }
    Ok(ExitCode::SUCCESS)
}
