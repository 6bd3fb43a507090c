//! Repository automation: `cargo xtask check | synth | tidy`.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::Command;
use waste_format::ExpertFmt;
use waste_synth::{shape_config, synth, SynthOptions, SHAPES};

mod synth_source;
mod tidy;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build everything and run every model-free check (what CI runs).
    Check {
        /// Skip the release build of the CLI smoke test.
        #[arg(long)]
        quick: bool,
    },
    /// Write a synthetic container.
    Synth {
        /// Shape: tiny, tiny-b, tiny-c, tiny-k3, kimi-linear-48b, k3.
        #[arg(long)]
        shape: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep only the first N layers.
        #[arg(long)]
        layers: Option<usize>,
        /// Expert format: vq3r, vq4p, vq2r, q4g, f16, bf16.
        #[arg(long, default_value = "vq3r")]
        experts: String,
        /// Manifest and sparse files only (enough for plan/info).
        #[arg(long)]
        manifest_only: bool,
        /// Router preference: uniform or skewed.
        #[arg(long, default_value = "uniform")]
        routing: String,
        /// Writer threads.
        #[arg(long, default_value_t = 2)]
        jobs: usize,
    },
    /// Check crate dependency direction and crate hygiene.
    Tidy,
    /// Clone HEAD into an empty temporary folder (no sibling data) and run the
    /// README's two commands there: the repository must stand alone.
    FreshCloneCheck,
    /// The main job on a synthetic model made on the fly.
    Demo,
    /// A short cargo-fuzz run of every target (needs nightly and cargo-fuzz; SKIP otherwise).
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
    },
    /// A synthetic Hugging Face-style source (bf16 or MXFP4 experts) at real expert shapes.
    SynthSource {
        /// kimi-linear or k3 (expert shapes).
        #[arg(long)]
        shape: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Experts in the one MoE layer.
        #[arg(long, default_value_t = 16)]
        experts: usize,
        /// MXFP4 experts (weight_packed + weight_scale) instead of bf16.
        #[arg(long)]
        mxfp4: bool,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Check { quick } => check(quick),
        Cmd::Synth { shape, out, seed, layers, experts, manifest_only, routing, jobs } => {
            let config = shape_config(&shape)
                .with_context(|| format!("unknown shape {shape:?} (known: {})", SHAPES.join(", ")))?;
            let experts = waste_format::ExpertQuant::parse_fmt(&experts)
                .with_context(|| format!("unknown --experts {experts:?} (vq3r, vq4p, vq2r, q4g, f16, bf16)"))?;
            let skewed = match routing.as_str() {
                "uniform" => false,
                "skewed" => true,
                o => bail!("unknown --routing {o:?} (uniform, skewed)"),
            };
            let opts = SynthOptions { config, layers, experts, seed, manifest_only, skewed, jobs };
            let last = std::sync::atomic::AtomicU64::new(0);
            let rep = synth(&out, &opts, &|d, t| {
                let pct = d * 100 / t.max(1);
                if pct != last.swap(pct, std::sync::atomic::Ordering::Relaxed) && pct % 5 == 0 {
                    eprint!("\rsynth {shape}: {pct}%");
                }
            })?;
            eprintln!();
            println!(
                "wrote {} ({} bytes in {:.2} s, {:.2} GB/s)",
                out.display(),
                rep.bytes,
                rep.seconds,
                rep.bytes as f64 / rep.seconds / 1e9
            );
            Ok(())
        }
        Cmd::Tidy => tidy::run(&root()),
        Cmd::FreshCloneCheck => fresh_clone_check(),
        Cmd::Demo => demo(),
        Cmd::Fuzz { seconds } => fuzz(seconds),
        Cmd::SynthSource { shape, out, experts, mxfp4, seed } => synth_source::run(&out, &shape, experts, mxfp4, seed),
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Cargo's release directory: under `CARGO_TARGET_DIR` when set (a common
/// global setting; relative to the workspace as cargo takes it), else the
/// workspace's `target/`.
fn release_dir() -> PathBuf {
    let root = root();
    let target = match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(d) => root.join(d),
        None => root.join("target"),
    };
    target.join("release")
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {cmd:?}");
    let t0 = std::time::Instant::now();
    let st = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    // each step's wall time, so a slow CI run says where its minutes went
    eprintln!("  ({:.0} s)", t0.elapsed().as_secs_f64());
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn fuzz(seconds: u64) -> Result<()> {
    let root = root();
    let ok = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIP: cargo fuzz needs a nightly toolchain and `cargo install cargo-fuzz`");
        return Ok(());
    }
    // chat_template renders Jinja in the limited child, as the waste binary
    // does; the CLI makes the state_file target's seed
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(&cargo).current_dir(&root).args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "waste-sandbox",
        "-p",
        "waste-cli",
    ]))?;
    let helper = release_dir().join("waste-render-template");
    let state = state_seed(&root)?;
    // inputs a fuzzer does not find alone from nothing (a PNG; a whole
    // saved state), and their length past libFuzzer's 4 KB default
    let seeded = |t: &str| match t {
        "image" => Some((root.join("tools/oracle/fixtures/k3-vision"), 1usize << 16)),
        "state_file" => Some((state.clone(), 1 << 17)),
        _ => None,
    };
    let runs = || -> Result<()> {
        for t in [
            "manifest",
            "record_header",
            "usage_file",
            "state_file",
            "tokenizer",
            "chat_request",
            "xtml_output",
            "safetensors_header",
            "chat_template",
            "image",
        ] {
            let mut cmd = Command::new("cargo");
            cmd.current_dir(root.join("fuzz")).env("WASTE_RENDER_HELPER", &helper).args(["+nightly", "fuzz", "run", t]);
            match seeded(t) {
                Some((dir, max_len)) => {
                    // libFuzzer refuses a named corpus directory that does not
                    // exist (cargo-fuzz makes its own only when none is named):
                    // a fresh clone has none
                    let corpus = root.join("fuzz/corpus").join(t);
                    std::fs::create_dir_all(&corpus).with_context(|| format!("create {}", corpus.display()))?;
                    cmd.arg(corpus).arg(dir).args(["--", &format!("-max_len={max_len}")])
                }
                None => cmd.arg("--"),
            };
            run(cmd.arg(format!("-max_total_time={seconds}")))?;
        }
        Ok(())
    };
    let done = runs();
    // the seed's directory is this run's own (created new), removed however the runs ended
    std::fs::remove_dir_all(&state).ok();
    done
}

/// A directory holding the `state_file` target's seed: a state the CLI
/// saves from the anchor model at the context that target opens it with
/// (64). The directory is made new (an existing one is an error, never
/// written into), so removing it afterwards removes only what this made.
fn state_seed(root: &Path) -> Result<PathBuf> {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("waste-fuzz-seeds-{}", std::process::id()));
    std::fs::create_dir(&dir).with_context(|| format!("create {} (a new directory)", dir.display()))?;
    let file = dir.join("anchor.state");
    let saved = (|| -> Result<()> {
        let mut chat = Command::new(release_dir().join("waste"))
            .args(["chat", "../testdata/anchor-tiny/kimi-linear-tiny.waste", "--ctx", "64", "-n", "4"])
            .current_dir(root.join("fuzz"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("spawn waste chat for the state seed")?;
        if let Some(mut stdin) = chat.stdin.take() {
            writeln!(stdin, "hello there\n/save {}", file.display()).context("write to waste chat")?;
        }
        let st = chat.wait().context("wait for waste chat")?;
        if !st.success() || !file.exists() {
            bail!("waste chat did not save the state seed {} ({st})", file.display());
        }
        Ok(())
    })();
    if saved.is_err() {
        std::fs::remove_dir_all(&dir).ok();
    }
    saved.map(|()| dir)
}

fn demo() -> Result<()> {
    let root = root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(&cargo).current_dir(&root).args(["build", "--quiet", "--release", "-p", "waste-cli"]))?;
    let dir = std::env::temp_dir().join("waste-demo-tiny.waste");
    let opts = SynthOptions {
        config: shape_config("tiny").expect("tiny shape"),
        layers: None,
        experts: ExpertFmt::Vq3r,
        seed: 1,
        manifest_only: false,
        skewed: true,
        jobs: 2,
    };
    synth(&dir, &opts, &|_, _| {}).with_context(|| {
        format!("writing the demo model (if {} is an older demo's, remove it and run again)", dir.display())
    })?;
    let waste = release_dir().join("waste");
    run(Command::new(&waste).arg("info").arg(&dir))?;
    run(Command::new(&waste).arg("verify").arg(&dir).arg("-q"))?;
    // a real generation: chat template, streaming, status line
    run(Command::new(&waste).arg("run").arg(&dir).args([
        "Tell me about streaming experts.",
        "-n",
        "48",
        "--temp",
        "0.8",
        "--seed",
        "1",
    ]))?;
    run(Command::new(&waste).arg("bench").arg(&dir).args(["-n", "16"]))?;
    Ok(())
}

/// The server against the official `openai` Python client, in a throwaway
/// venv (PyPI is reachable where CI runs). Without python3 it is a SKIP, said
/// loudly and listed at the end of `check`, never a pass.
fn openai_client_test(root: &Path, waste: &Path, skips: &mut Vec<String>) -> Result<()> {
    if Command::new("python3").arg("--version").output().is_err() {
        skips.push("openai client test: python3 not found (required)".into());
        return Ok(());
    }
    let venv = std::env::temp_dir().join("waste-ci-openai-venv");
    if !venv.join("bin/python").exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let py = venv.join("bin/python");
    if Command::new(&py).args(["-c", "import openai, jsonschema"]).output().map(|o| !o.status.success()).unwrap_or(true)
    {
        run(Command::new(&py).args(["-m", "pip", "install", "-q", "openai", "jsonschema"]))?;
    }
    let anchor = root.join("testdata").join("anchor-tiny/kimi-linear-tiny.waste");
    // K3 with a vision tower, converted from the oracle fixture, for the image request
    let fx = root.join("tools/oracle/fixtures");
    let vision = std::env::temp_dir().join(format!("waste-ci-k3-vision-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&vision);
    run(Command::new(waste)
        .args(["convert", "--experts", "f16", "--trunk", "f32", "-q", "--src"])
        .arg(fx.join("hf-k3-vision"))
        .arg("--out")
        .arg(&vision))?;
    // the anchor's weights speaking the Kimi K2 family's chat format
    // (Kimi-Linear's): its specials renamed, `<|im_end|>` at the end-of-
    // sequence id (as waste-cli/tests/common's K2_SPECIALS)
    let k2 = std::env::temp_dir().join(format!("waste-ci-k2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&k2);
    std::fs::create_dir_all(&k2)?;
    for e in std::fs::read_dir(&anchor)? {
        let e = e?;
        std::fs::copy(e.path(), k2.join(e.file_name()))?;
    }
    let names = [
        "[BOS]",
        "<|im_user|>",
        "<|im_end|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ];
    let specials: Vec<String> =
        names.iter().enumerate().map(|(i, t)| format!("{{\"id\": {}, \"text\": \"{t}\"}}", 305 + i)).collect();
    std::fs::write(k2.join("specials.json"), format!("[{}]", specials.join(", ")))?;
    let r = run(Command::new(&py)
        .arg(root.join("tools/serve_test/openai_client.py"))
        .arg(waste)
        .arg(anchor)
        .arg(&vision)
        .arg(fx.join("k3-vision/a.png"))
        .arg("--k2")
        .arg(&k2));
    let _ = std::fs::remove_dir_all(&vision);
    let _ = std::fs::remove_dir_all(&k2);
    r
}

fn check(quick: bool) -> Result<()> {
    let root = root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    tidy::run(&root)?;
    run(Command::new(&cargo).current_dir(&root).args(["fmt", "--all", "--check"]))?;
    run(Command::new(&cargo).current_dir(root.join("fuzz")).args(["fmt", "--check"]))?;
    // the fuzz targets live outside the workspace (cargo-fuzz wants that);
    // a stable `cargo check` keeps them compiling with the code they drive
    run(Command::new(&cargo).current_dir(root.join("fuzz")).args(["check", "--quiet", "--bins"]))?;
    // clippy in the dev profile: its dependencies' metadata is what `cargo
    // doc` reads next (with `--release` the doc step checked every
    // dependency again: clippy + doc 219 s against 158 s, fresh clone)
    run(Command::new(&cargo).current_dir(&root).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // the `waste` command's own docs (private items included) without a
    // broken link — before the workspace's: both write target/doc/waste
    // (the C library is named `waste` too), so they run one after the other
    // and the library's pages are the ones left
    run(Command::new(&cargo).current_dir(&root).args([
        "rustdoc",
        "-p",
        "waste-cli",
        "--bin",
        "waste",
        "--quiet",
        "--",
        "-D",
        "warnings",
    ]))?;
    // the API docs build without a broken link
    run(Command::new(&cargo).current_dir(&root).env("RUSTDOCFLAGS", "-D warnings").args([
        "doc",
        "--workspace",
        "--no-deps",
        "--quiet",
    ]))?;
    // tests that cannot run a check (a SIMD level this CPU lacks, ...) append
    // a line here; they are listed at the end, never counted as passes
    let skip_log = std::env::temp_dir().join(format!("waste-skips-{}.txt", std::process::id()));
    std::fs::write(&skip_log, "")?;
    let _gone = RemoveOnDrop(skip_log.clone());
    // rebuild first: stale binaries must not be tested
    run(Command::new(&cargo).current_dir(&root).args(["build", "--workspace", "--all-targets", "--release"]))?;
    run(Command::new(&cargo).current_dir(&root).env("WASTE_SKIP_LOG", &skip_log).args([
        "test",
        "--workspace",
        "--release",
        "--no-fail-fast",
    ]))?;
    let mut skips: Vec<String> = std::fs::read_to_string(&skip_log)?.lines().map(str::to_owned).collect();
    skips.sort();
    skips.dedup();
    cross(&root, &cargo, &mut skips)?;
    if !quick {
        // the README's main job, end to end on a fresh synthetic model
        let tmp = std::env::temp_dir().join(format!("waste-check-{}", std::process::id()));
        let _gone = RemoveOnDrop(tmp.clone());
        let waste = release_dir().join("waste");
        run(Command::new(&cargo)
            .current_dir(&root)
            .args(["run", "--quiet", "--release", "-p", "xtask", "--", "synth", "--shape", "tiny", "--out"])
            .arg(&tmp))?;
        run(Command::new(&waste).arg("info").arg(&tmp))?;
        run(Command::new(&waste).arg("verify").arg(&tmp))?;
        run(Command::new(&waste).arg("run").arg(&tmp).args(["hello", "-n", "16"]))?;
        openai_client_test(&root, &waste, &mut skips)?;
    }
    if skips.is_empty() {
        eprintln!("xtask check: skipped checks: none");
    } else {
        eprintln!("xtask check: skipped checks ({}):", skips.len());
        for s in &skips {
            eprintln!("  SKIP {s}");
        }
    }
    let required: Vec<&String> = skips.iter().filter(|s| s.contains("(required)")).collect();
    if !required.is_empty() && std::env::var_os("WASTE_REQUIRE_ALL").is_some_and(|v| v == "1") {
        bail!("WASTE_REQUIRE_ALL=1 and {} required check(s) skipped", required.len());
    }
    eprintln!("xtask check: all checks passed");
    Ok(())
}

/// Whether a command runs and succeeds.
fn works(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A temporary file or directory removed when the check ends, failed or not.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if self.0.is_dir() {
            std::fs::remove_dir_all(&self.0).ok();
        } else {
            std::fs::remove_file(&self.0).ok();
        }
    }
}

/// The aarch64 checks: the whole workspace type-checks for macOS and Linux
/// on ARM without a warning, and the format/quant/attn/moe/model suites run
/// under `qemu-aarch64 -cpu max`, the kernel suites and the anchor once more
/// on a plain `-cpu cortex-a53` (correctness only; timings under emulation
/// mean nothing). What this machine cannot provide (rustup targets, the
/// cross linker, qemu) is installed when possible, else listed as skipped —
/// a required skip where the tools could have been installed (rustup and
/// apt-get present): `WASTE_REQUIRE_ALL=1` then fails the run.
fn cross(root: &Path, cargo: &str, skips: &mut Vec<String>) -> Result<()> {
    let installable = works(Command::new("rustup").arg("--version")) && works(Command::new("apt-get").arg("--version"));
    let required = if installable { " (required)" } else { "" };
    let targets = ["aarch64-apple-darwin", "aarch64-unknown-linux-gnu"];
    if !works(Command::new("rustup").arg("target").arg("add").args(targets)) {
        skips.push(format!("aarch64 checks: `rustup target add` failed (no rustup or no network){required}"));
        return Ok(());
    }
    for t in targets {
        // without `remote-images`: rustls' `ring` compiles C for the target,
        // and there is no Apple C toolchain here (the Rust code is all checked)
        run(Command::new(cargo).current_dir(root).env("RUSTFLAGS", "-D warnings").args([
            "check",
            "--quiet",
            "--workspace",
            "--all-targets",
            "--no-default-features",
            "--target",
            t,
        ]))?;
    }
    let have = || {
        works(Command::new("qemu-aarch64").arg("--version"))
            && works(Command::new("aarch64-linux-gnu-gcc").arg("--version"))
    };
    if !have() {
        let _ = works(Command::new("apt-get").args(["update", "-qq"]));
        let _ = works(Command::new("apt-get").env("DEBIAN_FRONTEND", "noninteractive").args([
            "install",
            "-y",
            "-qq",
            "gcc-aarch64-linux-gnu",
            "libc6-dev-arm64-cross",
            "qemu-user",
        ]));
    }
    if !have() {
        skips.push(format!(
            "aarch64 tests under qemu: qemu-aarch64 or aarch64-linux-gnu-gcc missing and not installable{required}"
        ));
        return Ok(());
    }
    let qemu_test = |cpu: &str, args: &[&str]| {
        eprintln!("xtask: aarch64 tests under qemu-aarch64 -cpu {cpu}: {}", args.join(" "));
        run(Command::new(cargo)
            .current_dir(root)
            // suites with many fixtures run a set covering each path under
            // emulation (waste-model/tests/batch.rs)
            .env("WASTE_EMULATED", "1")
            .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc")
            .env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
                format!("qemu-aarch64 -cpu {cpu} -L /usr/aarch64-linux-gnu"),
            )
            .args(["test", "--quiet", "--release", "--target", "aarch64-unknown-linux-gnu"])
            .args(args))
    };
    // every optional feature present (the NEON level and the scalar one are
    // both forced by the suites, which walk every available level) … less
    // two measurements no ARM build can change, the slowest under emulation
    // (~80 of the step's ~220 s of tests): the fast mode's quality contracts
    // (its arithmetic is one definition at every level — ARM runs the
    // portable form the x86 suites hold every kernel to) and a synthetic
    // container's routing spread (the writer's, not a kernel's)
    qemu_test(
        "max",
        &[
            "-p",
            "waste-format",
            "-p",
            "waste-quant",
            "-p",
            "waste-attn",
            "-p",
            "waste-moe",
            "-p",
            "waste-model",
            "--",
            "--skip",
            "fast_meets_its_quality_contract",
            "--skip",
            "a_synthetic_48b_slice_routes_differently",
        ],
    )?;
    // … and a plain ARMv8.0 core (no dotprod/fp16/i8mm): the kernels use
    // only the base ISA, which this proves; the anchor logits must still
    // equal the x86_64 fixture bit for bit.
    qemu_test("cortex-a53", &["-p", "waste-quant", "-p", "waste-attn"])?;
    qemu_test("cortex-a53", &["-p", "waste-model", "--test", "anchor"])?;
    Ok(())
}

/// `git clone` of HEAD into an empty temporary folder, then the README's two
/// commands there. Nothing beside the clone: no `../shared`, no target dir.
fn fresh_clone_check() -> Result<()> {
    let root = root();
    let base = std::env::temp_dir().join(format!("waste-fresh-{}", std::process::id()));
    std::fs::create_dir_all(&base)?;
    let clone = base.join("waste-rs");
    run(Command::new("git").arg("clone").arg("--quiet").arg(&root).arg(&clone))?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let res = run(Command::new(&cargo).current_dir(&clone).env_remove("CARGO_TARGET_DIR").args(["xtask", "demo"]))
        .and_then(|()| {
            run(Command::new(&cargo).current_dir(&clone).env_remove("CARGO_TARGET_DIR").args(["xtask", "check"]))
        });
    std::fs::remove_dir_all(&base).ok();
    res?;
    eprintln!("fresh-clone-check: both README commands pass in a clone with nothing beside it");
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The built binaries are looked for where cargo put them: under
    /// `CARGO_TARGET_DIR` when set (absolute, or relative to the workspace),
    /// else `target/` (demo and check failed with "No such file" under a
    /// global CARGO_TARGET_DIR). The only test here that sets the variable.
    #[test]
    fn release_dir_follows_cargo_target_dir() {
        let old = std::env::var_os("CARGO_TARGET_DIR");
        std::env::set_var("CARGO_TARGET_DIR", "/x/t");
        assert_eq!(super::release_dir(), std::path::PathBuf::from("/x/t/release"));
        std::env::set_var("CARGO_TARGET_DIR", "rel");
        assert_eq!(super::release_dir(), super::root().join("rel/release"));
        std::env::remove_var("CARGO_TARGET_DIR");
        assert_eq!(super::release_dir(), super::root().join("target/release"));
        if let Some(o) = old {
            std::env::set_var("CARGO_TARGET_DIR", o);
        }
    }
}
