//! `waste`: the command-line client of the WASTE engine. Thin: parse,
//! call the library, print, map errors to an exit code and one clear line.

/// `println!` that returns the write error instead of panicking: a closed
/// pipe (`waste tokenize … | head`) then ends the command quietly, status 0.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($t)*)?;
    }};
}

mod answer;
mod bench_parallel;
mod cmd_cache;
mod cmd_convert;
mod cmd_eval;
mod cmd_info;
mod cmd_plan;
mod cmd_serve;
mod cmd_text;
mod progress;
mod repl;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "waste",
    version,
    about = "Run Mixture-of-Experts models far larger than RAM",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Container and model details.
    Info(cmd_info::InfoArgs),
    /// Check every expert record's header and CRC, trunk and codebook bounds.
    Verify(cmd_info::VerifyArgs),
    /// Version and build (SIMD level, format version).
    Version(cmd_info::VersionArgs),
    /// Measure this disk's read bandwidth (direct I/O, given record size and queue depth).
    Diskbench(cmd_info::DiskbenchArgs),
    /// The OpenAI-compatible server.
    Serve(cmd_serve::ServeArgs),
    /// Convert safetensors weights into a container.
    Convert(cmd_convert::ConvertArgs),
    /// Memory plan: floor breakdown and what a budget buys.
    Plan(cmd_plan::PlanArgs),
    /// Decode speed, hit rate, bytes per token, direct I/O.
    Bench(cmd_plan::BenchArgs),
    /// Replay a routing trace through the engine's expert cache.
    Cachesim(cmd_cache::CachesimArgs),
    /// Next-token distribution after a prompt.
    Eval(cmd_eval::EvalArgs),
    /// Generate from a prompt.
    Run(cmd_eval::RunArgs),
    /// Interactive chat (state kept across turns).
    Chat(cmd_text::ChatArgs),
    /// Text to token ids.
    Tokenize(cmd_text::TokenizeArgs),
    /// Token ids to text.
    Detokenize(cmd_text::DetokenizeArgs),
}

/// Exit status for a run that found problems (vs 1 = error, 2 = usage).
pub const EXIT_PROBLEMS: u8 = 3;

/// llama.cpp's spellings, which its users type: `-m MODEL` / `--model
/// MODEL` for the model every subcommand but `convert`, `diskbench`,
/// `cachesim` and `version` takes first, and `-p TEXT` / `--prompt TEXT`
/// for the prompt of `run` and `eval` — moved to where the positionals
/// are (`=VALUE` forms too). Given twice, or beside the positional, clap
/// sees both and says what is wrong.
fn llama_aliases(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let sub = args.get(1).and_then(|a| a.to_str()).unwrap_or("");
    let takes_model = matches!(
        sub,
        "run" | "chat" | "eval" | "serve" | "bench" | "info" | "plan" | "verify" | "tokenize" | "detokenize"
    );
    if !takes_model {
        return args;
    }
    let takes_prompt = matches!(sub, "run" | "eval");
    let (mut model, mut prompt, mut rest, mut after) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut it = args.into_iter();
    let head: Vec<_> = it.by_ref().take(2).collect();
    while let Some(a) = it.next() {
        let s = a.to_str().unwrap_or_default().to_string();
        if s == "--" {
            after.push(a);
            after.extend(it.by_ref());
            break;
        }
        let dest = match s.as_str() {
            "-m" | "--model" => Some(&mut model),
            "-p" | "--prompt" if takes_prompt => Some(&mut prompt),
            _ => None,
        };
        if let Some(d) = dest {
            // a flag without its value stays for clap to report
            match it.next() {
                Some(v) => d.push(v),
                None => rest.push(a),
            }
            continue;
        }
        if let Some(v) = s.strip_prefix("--model=") {
            model.push(v.into());
        } else if let Some(v) = s.strip_prefix("--prompt=").filter(|_| takes_prompt) {
            prompt.push(v.into());
        } else {
            rest.push(a);
        }
    }
    // with `-m`, the model then the prompt lead; without, the positional
    // model is somewhere in `rest` and the prompt goes after it
    if model.is_empty() {
        head.into_iter().chain(rest).chain(prompt).chain(after).collect()
    } else {
        head.into_iter().chain(model).chain(prompt).chain(rest).chain(after).collect()
    }
}

fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|a| a == waste_sandbox::SUBCOMMAND) {
        return waste_sandbox::serve_child(std::io::stdin().lock(), std::io::stdout().lock(), std::io::stderr().lock());
    }
    // chat templates render in a limited child process, this binary run
    // as `waste __render-template` (waste-sandbox); a binary that cannot
    // be found makes each rendering an error, never one in this process
    waste_sandbox::install(std::env::current_exe().unwrap_or_default());
    let cli = match Cli::try_parse_from(llama_aliases(std::env::args_os().collect())) {
        Ok(c) => c,
        Err(e) if e.use_stderr() => {
            eprintln!("{}", usage_error(&e.to_string()));
            return ExitCode::from(2);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    let r = match cli.cmd {
        Cmd::Info(a) => cmd_info::info(a),
        Cmd::Verify(a) => cmd_info::verify(a),
        Cmd::Version(a) => cmd_info::version(a),
        Cmd::Diskbench(a) => cmd_info::diskbench(a),
        Cmd::Cachesim(a) => cmd_cache::cachesim(a),
        Cmd::Plan(a) => cmd_plan::plan(a),
        Cmd::Convert(a) => cmd_convert::convert(a),
        Cmd::Serve(a) => cmd_serve::serve(a),
        Cmd::Bench(a) => cmd_plan::bench(a),
        Cmd::Eval(a) => cmd_eval::eval(a),
        Cmd::Run(a) => cmd_eval::run(a),
        Cmd::Chat(a) => cmd_text::chat(a),
        Cmd::Tokenize(a) => cmd_text::tokenize(a),
        Cmd::Detokenize(a) => cmd_text::detokenize(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if io.kind() == std::io::ErrorKind::BrokenPipe {
                    return ExitCode::SUCCESS;
                }
            }
            eprintln!("error: {}", describe(&e));
            ExitCode::FAILURE
        }
    }
}

/// A clap error as shown: everything it says before its usage block (the
/// missing arguments by name, "a similar argument exists", the possible
/// values), then a pointer to `--help` instead of the usage page.
fn usage_error(msg: &str) -> String {
    let said: Vec<&str> = msg
        .lines()
        .take_while(|l| !l.starts_with("Usage:"))
        .filter(|l| !l.starts_with("For more information"))
        .map(str::trim_end)
        .collect();
    let said = said.join("\n");
    let said = said.trim();
    format!("{}\n(see --help)", if said.is_empty() { "error: bad arguments" } else { said })
}

/// An error and its causes on one line, outermost first, each cause said
/// once: the engine's errors already put their OS error in their own
/// message, which `{:#}` would repeat ("…: No such file (os error 2): No
/// such file (os error 2)").
pub fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if out.is_empty() {
            out = c;
        } else if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

/// Print a JSON value (pretty) to stdout.
///
/// # Errors
/// The write error (a closed pipe among them; `main` ends quietly on that one).
pub fn print_json(v: &serde_json::Value) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(v)?)?;
    Ok(())
}
