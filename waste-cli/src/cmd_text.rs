//! `waste chat`, `waste tokenize`, `waste detokenize`.

use crate::cmd_eval::{parse_ids, queue_images, read_images, read_prompt, status_line, EngineArgs, SampleArgs};
use crate::print_json;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use waste_model::tokenizer::{Message, Pattern, Tokenizer};

#[derive(Args)]
pub struct ChatArgs {
    /// Container directory.
    model: PathBuf,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Think first (K3's tagged format): `--think` for max, `--think=LEVEL`
    /// for none, low, medium, high or max; the reasoning is shown dimmed on
    /// stderr.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "max", value_name = "LEVEL", value_parser = crate::answer::LEVELS)]
    think: Option<String>,
    /// An image for the first message (repeatable); later ones with `/image FILE`.
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
    /// Do not load the vision tower (saves its memory; `/image` is then refused).
    #[arg(long)]
    no_images: bool,
    #[command(flatten)]
    sample: SampleArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// What the chat REPL's commands are (`/help`, and after a wrong one).
const CHAT_COMMANDS: &str = "commands: /reset, /save FILE, /load FILE, /image FILE, /stats, /help, /quit (Ctrl-D)";

/// The chat REPL: state is kept across turns; `/reset`, `/save F`, `/load F`, `/stats`, Ctrl-D.
pub fn chat(mut a: ChatArgs) -> Result<ExitCode> {
    if a.no_images && !a.images.is_empty() {
        bail!("--image and --no-images contradict each other");
    }
    a.sample.check()?;
    // the tower is loaded when the container has one (for /image), unless --no-images
    a.engine.vision = !a.images.is_empty() || (!a.no_images && a.model.join("vision.json").is_file());
    // with no image given, a tower that cannot load leaves the chat text-only
    a.engine.vision_optional = a.images.is_empty();
    let model = a.engine.open(&a.model)?;
    eprintln!("[{}]", crate::cmd_eval::budget_line(&model));
    let mut pending = read_images(&model, &a.images)?;
    let chat = crate::answer::Chat::new(&model, crate::answer::effort(a.think.as_deref())?, None);
    let params = chat.params(a.sample.params());
    let mut s = model.session();
    let mut out = std::io::stdout().lock();
    let mut first = true;
    let mut input = crate::repl::Input::new();
    // in a terminal Ctrl-C stops the answer being written, not the process;
    // piped input keeps the default (Ctrl-C ends a blocked read there)
    if input.is_terminal() {
        crate::repl::catch_ctrl_c();
    }
    loop {
        let line = match input.read()? {
            crate::repl::Line::Text(l) => l,
            crate::repl::Line::Interrupted => {
                eprintln!("[Ctrl-C: nothing to stop; Ctrl-D or /quit leaves]");
                continue;
            }
            crate::repl::Line::End => break,
        };
        let line = line.as_str();
        // nothing to say: a line of spaces is not a turn
        if line.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = line.strip_prefix('/') {
            let (c, arg) = cmd.split_once(' ').map(|(c, a)| (c, a.trim())).unwrap_or((cmd, ""));
            match c {
                "reset" => {
                    s.reset();
                    first = true;
                    eprintln!("[reset]");
                }
                // a failed save or load is reported and the conversation goes on
                "save" if !arg.is_empty() => match s.save_state(arg) {
                    Ok(()) => eprintln!("[saved {} tokens to {arg}]", s.position()),
                    Err(e) => eprintln!("error: saving {arg}: {e} (the conversation is kept)"),
                },
                "load" if !arg.is_empty() => match s.load_state(arg) {
                    Ok(()) => {
                        first = s.position() == 0;
                        eprintln!("[loaded {} tokens from {arg}]", s.position());
                    }
                    Err(e) => eprintln!("error: loading {arg}: {e} (the conversation is kept)"),
                },
                "image" if !arg.is_empty() => match read_images(&model, &[PathBuf::from(arg)]) {
                    Ok(mut f) if model.vision().is_some() => {
                        eprintln!("[image {arg}: {}x{}, for the next message]", f[0].width, f[0].height);
                        pending.append(&mut f);
                    }
                    Ok(_) => match model.vision_error() {
                        Some(e) => eprintln!("error: images are off: the vision tower could not load ({e})"),
                        None => eprintln!("error: this model has no vision tower loaded (images need K3's tower)"),
                    },
                    Err(e) => eprintln!("error: {}", crate::describe(&e)),
                },
                "stats" => {
                    let st = s.stats();
                    let cs = model.cache_stats();
                    eprintln!("[position {} / {} | experts {} hit / {} miss | {} bytes read | cache {} slots, {} evictions | direct I/O {}]", s.position(), model.options().ctx, st.experts_hit, st.experts_missed, st.bytes_read, model.cache_slots(), cs.evictions, model.direct_io());
                }
                "quit" | "exit" => break,
                "save" | "load" | "image" => eprintln!("error: /{c} needs a file: /{c} FILE"),
                "help" | "?" => eprintln!("{CHAT_COMMANDS}"),
                _ => eprintln!("error: no command /{c}; {CHAT_COMMANDS}"),
            }
            continue;
        }
        let mut msgs = vec![];
        if first {
            if let Some(sys) = &a.system {
                msgs.push(Message::new("system", sys));
            }
        }
        let dims: Vec<(u32, u32)> = pending.iter().map(|i| (i.width, i.height)).collect();
        msgs.push(Message::new("user", line).with_images(&dims));
        let ids = chat.encode(&msgs, !first)?;
        let mut extra = 0;
        for f in &pending {
            extra += model.image_positions(&f.bytes)?.saturating_sub(1);
        }
        if s.position() + ids.len() + extra >= model.options().ctx {
            eprintln!("[the context is full: /reset or /save]");
            continue;
        }
        first = false;
        if let Err(e) = queue_images(&mut s, &ids, &pending) {
            s.clear_images();
            pending.clear();
            eprintln!("error: {} (the images were dropped)", crate::describe(&e));
            continue;
        }
        pending.clear();
        let t0 = std::time::Instant::now();
        let st0 = s.stats();
        let mut printer = chat.printer(true);
        // the first token comes after the prompt's prefill: the split of the status line
        let mut first_token: Option<std::time::Instant> = None;
        let _ = crate::repl::take_cancel();
        let mut cancelled = false;
        let turn = s.generate(&ids, &params, |ev| {
            first_token.get_or_insert_with(std::time::Instant::now);
            let _ = printer.push(&ev.piece, &mut out, true);
            if crate::repl::take_cancel() {
                cancelled = true;
                return waste_model::Control::Cancel;
            }
            waste_model::Control::Continue
        });
        writeln!(out)?;
        // close the assistant turn so the next one starts clean
        let turn = turn.map_err(anyhow::Error::from).and_then(|g| {
            let close = chat.close(&printer, &g.finish)?;
            if !close.is_empty() && s.position() + close.len() < model.options().ctx {
                s.eval(&close)?;
            }
            Ok(g)
        });
        // a turn the engine could not finish (a read error, a damaged
        // record) leaves the session half-updated: reported, and the REPL
        // goes on from an empty conversation rather than exiting
        let g = match turn {
            Ok(g) => g,
            Err(e) => {
                s.reset();
                first = true;
                eprintln!(
                    "error: {} (the conversation was reset; /load a saved state to go back)",
                    crate::describe(&e)
                );
                continue;
            }
        };
        let d = s.stats() - st0;
        if g.finish == waste_model::Finish::ContextFull {
            eprintln!("[stopped: the context is full]");
        }
        if cancelled {
            eprintln!("[stopped by Ctrl-C; the conversation is kept]");
        }
        let end = std::time::Instant::now();
        let first_at = first_token.unwrap_or(end);
        let prompt = (ids.len(), (first_at - t0).as_secs_f64());
        status_line(prompt, (g.tokens.len().saturating_sub(1), (end - first_at).as_secs_f64()), &d);
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct TokenizeArgs {
    /// `MODEL TEXT`, or just `TEXT` with --tiktoken (`-` = stdin; stdin also when piped).
    #[arg(num_args = 0..=2)]
    args: Vec<String>,
    /// Text (alternative to the positional).
    #[arg(long, short)]
    text: Option<String>,
    /// A tiktoken rank file instead of a container.
    #[arg(long)]
    tiktoken: Option<PathBuf>,
    /// Pre-tokenizer pattern with --tiktoken: kimi, o200k, cl100k.
    #[arg(long, default_value = "kimi")]
    pattern: String,
    /// Recognise special tokens (template markup).
    #[arg(long)]
    markup: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn load_tokenizer(model: &Option<PathBuf>, tiktoken: &Option<PathBuf>, pattern: &str) -> Result<Tokenizer> {
    let pat =
        Pattern::parse(pattern).with_context(|| format!("--pattern {pattern:?}: expected kimi, o200k or cl100k"))?;
    match (model, tiktoken) {
        (Some(m), None) => Ok(Tokenizer::from_container_dir(m)?),
        (None, Some(f)) => Ok(Tokenizer::from_files(f, None, pat)?),
        (Some(_), Some(_)) => bail!("give a container or --tiktoken, not both"),
        (None, None) => bail!("give a container or --tiktoken FILE"),
    }
}

/// Split `[MODEL] [VALUE]` positionals: with --tiktoken there is no MODEL.
fn split_positionals(
    args: &[String],
    tiktoken: bool,
    named: &Option<String>,
) -> Result<(Option<PathBuf>, Option<String>)> {
    let (model, value) = match (tiktoken, args) {
        (true, [v]) => (None, Some(v.clone())),
        (true, []) => (None, None),
        (true, _) => bail!("with --tiktoken give only the text"),
        (false, [m]) => (Some(PathBuf::from(m)), None),
        (false, [m, v]) => (Some(PathBuf::from(m)), Some(v.clone())),
        (false, _) => (None, None),
    };
    match (value, named) {
        (Some(_), Some(_)) => bail!("give the value once (positional or option)"),
        (v, n) => Ok((model, v.or_else(|| n.clone()))),
    }
}

pub fn tokenize(a: TokenizeArgs) -> Result<ExitCode> {
    let (model, text) = split_positionals(&a.args, a.tiktoken.is_some(), &a.text)?;
    let t = load_tokenizer(&model, &a.tiktoken, &a.pattern)?;
    let text = read_prompt(&text, &None)?.context("no text: give it as an argument, or - for stdin")?;
    let ids = if a.markup { t.encode_markup(&text) } else { t.encode_plain(&text) };
    if a.json {
        print_json(&json!({"ids": ids}))?;
    } else {
        outln!("{}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "));
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct DetokenizeArgs {
    /// `MODEL IDS`, or just `IDS` with --tiktoken; ids comma- or space-separated (`-` = stdin).
    #[arg(num_args = 0..=2)]
    args: Vec<String>,
    /// Ids (alternative to the positional).
    #[arg(long)]
    ids: Option<String>,
    /// A tiktoken rank file instead of a container.
    #[arg(long)]
    tiktoken: Option<PathBuf>,
    /// Pre-tokenizer pattern with --tiktoken.
    #[arg(long, default_value = "kimi")]
    pattern: String,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn detokenize(a: DetokenizeArgs) -> Result<ExitCode> {
    let (model, ids) = split_positionals(&a.args, a.tiktoken.is_some(), &a.ids)?;
    let t = load_tokenizer(&model, &a.tiktoken, &a.pattern)?;
    let raw = read_prompt(&ids, &None)?.context("no ids: give them as an argument (1,2,3), or - for stdin")?;
    let ids = parse_ids(&raw)?;
    // an unknown id decodes to nothing: say so instead of printing less text
    if let Some(bad) = ids.iter().find(|&&i| !t.has_id(i)) {
        bail!("token id {bad} is not in the tokenizer's vocabulary ({} ids)", t.vocab_len());
    }
    let text = t.decode(&ids);
    if a.json {
        print_json(&json!({"text": text}))?;
    } else {
        outln!("{text}");
    }
    Ok(ExitCode::SUCCESS)
}
