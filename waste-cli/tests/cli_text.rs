//! The text interface of `waste` on the anchor container: run from an
//! argument and from stdin, tokenize/detokenize, and a chat saved after two
//! turns and reloaded in a new process continuing with exactly the same text.

#[path = "../../tests-support/c_vision.rs"]
mod c_vision;
mod common;
#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;

use common::{anchor, waste, waste_in, waste_numeric};

#[test]
fn chat_state_saved_after_two_turns_continues_identically_in_a_new_process() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let f = std::env::temp_dir().join(format!("waste-chat-{}.state", std::process::id()));
    let fs = f.to_str().unwrap();
    let (code, out_a, err) = waste(
        &["chat", m, "-n", "10"],
        &format!("hello there\nwhat is the weather\n/save {fs}\ntell me about Paris\n"),
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[saved"), "{err}");
    let (code, out_b, err) = waste(&["chat", m, "-n", "10"], &format!("/load {fs}\ntell me about Paris\n"));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[loaded"), "{err}");
    assert!(out_b.len() > 1, "third turn produced no text");
    assert!(out_a.ends_with(&out_b), "uninterrupted:\n{out_a:?}\nreloaded:\n{out_b:?}");
    // the saved state held both earlier turns
    let n: usize = err.split("[loaded ").nth(1).and_then(|r| r.split(' ').next()).and_then(|x| x.parse().ok()).unwrap();
    assert!(n > 20, "{err}");
    std::fs::remove_file(&f).ok();
}

#[test]
fn run_reads_argument_or_stdin_and_prints_json() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let (code, out, err) = waste(&["run", m, "the weather in Paris", "-n", "6", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 6);
    let (code, out2, _) = waste(&["run", m, "-", "-n", "6", "--json"], "the weather in Paris");
    assert_eq!(code, 0);
    let v2: serde_json::Value = serde_json::from_str(&out2).unwrap();
    assert_eq!(v["tokens"], v2["tokens"]);
    // the status line gives the prompt's rate and the generation's apart
    let (code, _, err) = waste(&["run", m, "the weather in Paris", "-n", "6"], "");
    assert_eq!(code, 0, "{err}");
    let line = err.lines().find(|l| l.starts_with("[prompt ")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains(" tok/s | generated 6 tokens, ") && line.contains("| experts "), "{line}");
    // the issue-3 id interface still works
    let (code, out, _) = waste(&["run", m, "--ids", "305", "-n", "9", "--temp", "0", "--json"], "");
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"], serde_json::json!([8, 119, 178, 172, 205, 117, 277, 272, 78]));
}

#[test]
fn tokenize_detokenize_roundtrip_and_modes() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let (code, out, _) = waste(&["tokenize", m, "<|open|>hello", "--json"], "");
    assert_eq!(code, 0);
    let plain: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(!plain["ids"].as_array().unwrap().contains(&serde_json::json!(308)));
    let (_, out, _) = waste(&["tokenize", m, "--text", "<|open|>hello", "--markup", "--json"], "");
    let markup: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(markup["ids"][0], 308);
    let ids: Vec<String> = plain["ids"].as_array().unwrap().iter().map(|x| x.to_string()).collect();
    let (_, out, _) = waste(&["detokenize", m, &ids.join(",")], "");
    assert_eq!(out.trim_end(), "<|open|>hello");
    // an id outside the vocabulary is an error, not silently less text
    let (code, out, err) = waste(&["detokenize", m, &format!("{},99999999", ids[0])], "");
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("token id 99999999 is not in the tokenizer's vocabulary"), "{err}");
    // stdin with `-`, and the standalone tiktoken form
    let (_, out2, _) = waste(&["tokenize", m, "-", "--json"], "<|open|>hello");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out2).unwrap(), plain);
    let o200k = anchor().join("../../tokenizers/o200k_base.tiktoken");
    let (code, out, err) =
        waste(&["tokenize", "--tiktoken", o200k.to_str().unwrap(), "--pattern", "o200k", "hello world", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let ids: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ids["ids"], serde_json::json!([24912, 2375]), "tiktoken's o200k ids for 'hello world'");
    let (code, _, err) = waste(&["tokenize", "--pattern", "nope", "--tiktoken", "/x"], "");
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn run_json_schema_is_enforced_and_thinking_goes_to_stderr() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let schema = std::env::temp_dir().join(format!("waste-schema-{}.json", std::process::id()));
    std::fs::write(&schema, r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "k": {"enum": ["a", "b"]}}, "required": ["n", "k"], "additionalProperties": false}"#).unwrap();
    let sc = schema.to_str().unwrap();
    for seed in ["1", "2", "3"] {
        for raw in [false, true] {
            let mut args = vec![
                "run",
                m,
                "give me json",
                "--json-schema",
                sc,
                "--temp",
                "1",
                "--seed",
                seed,
                "-n",
                "200",
                "--json",
            ];
            if raw {
                args.push("--raw");
            }
            let (code, out, err) = waste(&args, "");
            assert_eq!(code, 0, "{err}");
            let r: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(r["finish_reason"], "stop", "{out}");
            let v: serde_json::Value =
                serde_json::from_str(r["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{out}: {e}"));
            assert!(
                (1..=9).contains(&v["n"].as_i64().unwrap()) && ["a", "b"].contains(&v["k"].as_str().unwrap()),
                "{v}"
            );
            assert_eq!(v.as_object().unwrap().len(), 2);
        }
    }
    std::fs::remove_file(&schema).ok();
    // thinking: the reasoning is apart from the answer (stderr when streamed)
    let (code, out, err) = waste(&["run", m, "hello", "--think", "-n", "12", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(!r["reasoning"].as_str().unwrap().is_empty(), "{out}");
    let (_, plain_out, plain_err) = waste(&["run", m, "hello", "--think", "-n", "12", "-q"], "");
    assert!(plain_err.contains(r["reasoning"].as_str().unwrap()), "{plain_err:?}");
    assert_eq!(plain_out.trim_end_matches('\n'), r["text"].as_str().unwrap());
    let (code, _, err) = waste(&["run", m, "hello", "--think=huge"], "");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("none, low, medium, high, max"), "{err}");
    // a prompt after a bare --think is the prompt, not the level
    let (code, out2, err) = waste(&["run", m, "--think", "hello", "-n", "12", "--json"], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out2).unwrap()["reasoning"], r["reasoning"]);
    // the server's levels: medium thinks, none is the answer without thinking
    let (code, _, err) = waste(&["run", m, "hello", "--think=medium", "-n", "4"], "");
    assert_eq!(code, 0, "{err}");
    let json = |args: &[&str]| serde_json::from_str::<serde_json::Value>(&waste(args, "").1).unwrap();
    let (none, off) = (
        json(&["run", m, "hello", "--think=none", "-n", "6", "--json"]),
        json(&["run", m, "hello", "-n", "6", "--json"]),
    );
    assert_eq!((&none["prompt_ids"], &none["tokens"]), (&off["prompt_ids"], &off["tokens"]));
}

/// `chat` on a K3 container written by the C converter whose tower cannot
/// load (here: its vision.json names a width the tensors do not have) runs
/// text and says why images are off; an image in the chat is refused with
/// that reason, and `run --image` (images asked for) fails naming the tensor.
#[test]
fn chat_opens_a_container_whose_tower_cannot_load() {
    let src = c_vision::c_vision_dir(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("waste-broken-tower-{}", std::process::id()));
    let m = c_vision::broken_tower_copy(env!("CARGO_MANIFEST_DIR"), &dir.join("k3.waste"));
    let (ms, png) = (m.to_str().unwrap(), src.join("img_w84_h56.png"));
    let (code, out, err) = waste(&["chat", ms, "-n", "4"], &format!("hello\n/image {}\nhi again\n", png.display()));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("images are off") && err.contains("the tower needs"), "{err}");
    let image_line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("no /image error: {err}"));
    assert!(image_line.contains("could not load") && image_line.contains("the tower needs"), "{image_line}");
    assert!(!out.trim().is_empty(), "no text generated: {err}");
    let (code, _, err) = waste(&["run", ms, "hi", "-n", "2", "--image", png.to_str().unwrap()], "");
    assert_ne!(code, 0);
    assert!(err.contains("vision_tower.") && err.contains("the tower needs"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `eval MODEL "text" --image F…` as the C WASTE's CLI: the media blocks
/// before the text, no template; on the C converter's container its logits
/// are the C engine's (testdata/c-k3-vision), and `-` reads the text from stdin.
#[test]
fn eval_takes_text_and_images_as_the_c_cli() {
    let dir = c_vision::c_vision_dir(env!("CARGO_MANIFEST_DIR"));
    let m = dir.join("k3-vision-tiny.waste");
    let (a, b) = (dir.join("img_w84_h56.png"), dir.join("img_w50_h33.png"));
    let args = [m.to_str().unwrap(), "--image", a.to_str().unwrap(), "--image", b.to_str().unwrap()];
    // the C engine's arithmetic is exact's
    let args = [&args[..], &["--exact"]].concat();
    let (code, out, err) = waste(&[&["eval"][..], &args, &["Describe: ", "--logits", "--json"]].concat(), "");
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("c-eval-both.json")).unwrap()).unwrap();
    assert_eq!(v["positions"], c["prompt_tokens"]);
    let logits = v["logits"].as_array().unwrap();
    for e in c["top"].as_array().unwrap() {
        let (id, want) = (e["id"].as_u64().unwrap() as usize, e["logit"].as_f64().unwrap());
        let got = logits[id].as_f64().unwrap();
        assert!((got - want).abs() <= 2e-3, "id {id}: {got} against the C engine's {want}");
    }
    assert_eq!(v["argmax"], c["top"][0]["id"]);
    // the C converter's K3 container is read by the K3 family's module
    let (code, out, err) = waste(&["info", m.to_str().unwrap(), "--json"], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["family"], "kimi-k3");
    // the text from stdin: the same
    let (code, out2, err) = waste(&[&["eval"][..], &args, &["-", "--logits", "--json"]].concat(), "Describe: ");
    assert_eq!(code, 0, "{err}");
    let v2: serde_json::Value = serde_json::from_str(&out2).unwrap();
    assert_eq!(v2["logits"], v["logits"]);
    // ids and text together are refused
    let (code, _, err) = waste(&["eval", m.to_str().unwrap(), "hi", "--ids", "1,2"], "");
    assert!(code != 0 && err.contains("not both"), "{err}");
}

/// One id format everywhere: what `tokenize` prints (spaces) is what `run`
/// and `eval` take, as are commas; an empty item (`1,,2`) is refused; `run`
/// refuses a prompt beside `--ids` instead of dropping it.
#[test]
fn token_ids_in_one_format_everywhere() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let (code, out, err) = waste(&["tokenize", m, "the weather in Paris"], "");
    assert_eq!(code, 0, "{err}");
    let spaced = out.trim().to_string();
    assert!(spaced.contains(' ') && !spaced.contains(','), "{spaced}");
    let commas = spaced.split_whitespace().collect::<Vec<_>>().join(",");
    let eval = |ids: &str| {
        let (code, out, err) = waste(&["eval", m, "--ids", ids, "--top", "3", "--json"], "");
        assert_eq!(code, 0, "{ids:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["top"].clone()
    };
    assert_eq!(eval(&spaced), eval(&commas));
    assert_eq!(eval(&commas.replace(',', ", ")), eval(&commas));
    for bad in ["1,,2", "1,2,", "1,x"] {
        let (code, _, err) = waste(&["eval", m, "--ids", bad], "");
        assert!(code != 0 && err.contains("--ids"), "{bad}: {err}");
    }
    let (code, _, err) = waste(&["run", m, "hello", "--ids", &commas, "-n", "1"], "");
    assert!(code != 0 && err.contains("not both"), "{err}");
    let (code, out, err) = waste(&["detokenize", m, &spaced], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim_end(), "the weather in Paris");
}

/// Unseeded sampled runs differ from run to run (a fresh seed each, printed
/// with --json) and the printed seed repeats a run; the names a llama.cpp
/// user types work as aliases (`--temperature`, `--n-predict`, `-c`,
/// `--ctx-size`).
#[test]
fn a_fresh_seed_each_run_printed_to_repeat_it_and_llama_cpp_names() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let json = |args: &[&str]| {
        let (code, out, err) = waste(args, "");
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let base = ["run", m, "hello", "--temp", "1", "-n", "6", "--json"];
    let (r1, r2) = (json(&base), json(&base));
    assert_ne!(r1["seed"], r2["seed"], "two unseeded runs drew the same seed");
    let seed = r1["seed"].as_u64().unwrap().to_string();
    let again = json(&[&base[..], &["--seed", &seed]].concat());
    assert_eq!((&again["seed"], &again["tokens"]), (&r1["seed"], &r1["tokens"]));
    let alias =
        json(&["run", m, "hello", "--temperature", "1", "--n-predict", "6", "-c", "512", "--seed", &seed, "--json"]);
    assert_eq!(alias["tokens"], r1["tokens"]);
    let ctx = json(&["run", m, "hello", "--ctx-size", "512", "-n", "2", "--json"]);
    assert_eq!(ctx["tokens"].as_array().unwrap().len(), 2);
}

/// The chat REPL says what was wrong with a command (an unknown one, a
/// missing file), sends no turn for a line of spaces, and a file that is not
/// a state is named without an internal label.
#[test]
fn chat_commands_say_what_was_wrong() {
    let a = anchor();
    let bad = std::env::temp_dir().join(format!("waste-not-a-state-{}", std::process::id()));
    std::fs::write(&bad, b"not a state").unwrap();
    let input = format!("/foo\n/save\n   \n/load {}\n", bad.display());
    let (code, out, err) = waste(&["chat", a.to_str().unwrap(), "-n", "2"], &input);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("error: no command /foo; commands: /reset"), "{err}");
    assert!(err.contains("error: /save needs a file: /save FILE"), "{err}");
    assert!(!err.contains("[prompt ") && out.trim().is_empty(), "a line of spaces was sent: {err}");
    assert!(err.contains("not a WASTE state file") && !err.contains("manifest key"), "{err}");
    std::fs::remove_file(&bad).ok();
}

/// `run` says what budget it runs with and what its cache holds; where
/// not every expert fits it names the budget that would hold them all, and
/// that budget does.
#[test]
fn run_names_its_budget_and_what_a_bigger_one_buys() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let (code, _, err) = waste(&["run", m, "hi", "-n", "1", "--budget", "0"], "");
    assert_eq!(code, 0, "{err}");
    let line = err.lines().find(|l| l.starts_with("[budget ")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("(automatic): an expert cache of "), "{line}");
    if let Some(rest) = line.split("every expert would fit at --budget ").nth(1) {
        let b = rest.split(' ').next().unwrap();
        let (code, _, err) = waste(&["run", m, "hi", "-n", "1", "--budget", b], "");
        assert_eq!(code, 0, "{err}");
        let line = err.lines().find(|l| l.starts_with("[budget ")).unwrap_or_else(|| panic!("{err}"));
        assert!(line.contains("(given)") && line.contains("(100 %)") && !line.contains("would fit"), "{line}");
    } else {
        assert!(line.contains("(100 %)"), "{line}");
    }
    // -q: nothing but the text
    let (_, _, err) = waste(&["run", m, "hi", "-n", "1", "-q"], "");
    assert!(!err.contains("[budget "), "{err}");
}

/// Where the cache cannot pin a layer's experts at once, `run` says a
/// prefill chunk's come in waves (of the size `plan` states), and not
/// where it can.
#[test]
fn run_says_when_a_prefill_chunk_s_experts_come_in_waves() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let plan = |budget: &str| {
        let (code, out, err) = waste(&["plan", m, "--budget", budget, "--json"], "");
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let floor = plan("0")["floor_bytes"].as_u64().unwrap().to_string();
    let at_floor = plan(&floor);
    let n = at_floor["expert_wave"].as_u64().unwrap_or_else(|| panic!("the floor's cache pins a layer: {at_floor}"));
    assert!(plan("0")["expert_wave"].is_null());
    let budget_line = |budget: &str| {
        let (code, _, err) = waste(&["run", m, "hi", "-n", "1", "--budget", budget], "");
        assert_eq!(code, 0, "{err}");
        err.lines().find(|l| l.starts_with("[budget ")).unwrap_or_else(|| panic!("{err}")).to_string()
    };
    let short = budget_line(&floor);
    assert!(short.contains(&format!("; a prefill chunk's experts in waves of {n}: the cache cannot pin")), "{short}");
    let whole = budget_line("0");
    assert!(!whole.contains("waves"), "{whole}");
}

/// The chat REPL in a terminal (a pty made by util-linux `script`): the up
/// arrow recalls the last line (history), Ctrl-C stops a running answer
/// and the conversation goes on, `/save` writes the state, Ctrl-D leaves,
/// and the lines are kept in the history file of the user's data directory.
#[test]
fn chat_in_a_terminal_has_history_ctrl_c_and_save() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    if std::process::Command::new("script").arg("--version").output().is_err() {
        println!("SKIP: chat REPL in a terminal (util-linux `script` is not installed)");
        return;
    }
    let home = std::env::temp_dir().join(format!("waste-repl-home-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let state = home.join("s.state");
    // `script` runs the command through $SHELL -c (else /bin/sh); `exec`
    // makes the chat the terminal's foreground process whatever the shell:
    // dash stays the parent otherwise, and Ctrl-C's SIGINT to the process
    // group then ends it with 130 after the chat has gone on (CI ran dash).
    let cmd = format!("exec {} chat {} -n 100000 --ctx 60000", env!("CARGO_BIN_EXE_waste"), anchor().to_str().unwrap());
    let mut child = std::process::Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("HOME", &home)
        .env("SHELL", "/bin/sh")
        .env_remove("XDG_DATA_HOME")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::<u8>::new()));
    let mut stdout = child.stdout.take().unwrap();
    let s2 = seen.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            s2.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let text = || String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    // waits for what the REPL prints (a deadline against a hang, not a speed check)
    let wait = |what: &str, ok: &dyn Fn(&str) -> bool| {
        let t0 = std::time::Instant::now();
        while !ok(&text()) {
            assert!(t0.elapsed() < std::time::Duration::from_secs(120), "waiting for {what}:\n{}", text());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let mut stdin = child.stdin.take().unwrap();
    let mut send = |b: &[u8]| {
        stdin.write_all(b).unwrap();
        stdin.flush().unwrap();
    };
    wait("the prompt", &|t| t.contains("> "));
    send(b"hello\r");
    // the answer is being written (100 000 tokens: far from done)
    let before = text().len();
    wait("the answer", &|t| t.len() > before + 400);
    send(b"\x03");
    wait("the stop", &|t| t.contains("[stopped by Ctrl-C; the conversation is kept]"));
    send(b"/stats\r");
    wait("stats", &|t| t.matches("[position ").count() == 1);
    send(b"\x1b[A\r"); // up arrow: /stats again
    wait("stats from history", &|t| t.matches("[position ").count() == 2);
    send(format!("/save {}\r", state.display()).as_bytes());
    wait("the save", &|t| t.contains("[saved "));
    send(b"\x04");
    let st = child.wait().unwrap();
    reader.join().unwrap();
    assert!(st.success(), "{st:?}\n{}", text());
    // the conversation survived Ctrl-C: the saved state holds it
    let n: usize =
        text().split("[saved ").nth(1).and_then(|r| r.split(' ').next()).and_then(|x| x.parse().ok()).unwrap();
    assert!(n > 40, "{}", text());
    let hist = std::fs::read_to_string(home.join(".local/share/waste/chat_history")).unwrap();
    assert!(hist.contains("hello") && hist.contains("/stats"), "{hist}");
    std::fs::remove_dir_all(&home).ok();
}

/// `chat` on a model in the K2 family's format (Kimi-Linear's): the first
/// turn's prompt is the reference template's (its default system turn, the
/// user turn, the generation prompt); a follow-up turn adds only its own
/// turn — the default system turn opens a conversation once.
#[test]
fn chat_in_the_k2_format_opens_the_conversation_once() {
    let d = common::copy_anchor_k2("k2-chat");
    let m = d.to_str().unwrap();
    let (code, out, err) = waste(&["chat", m, "-n", "3", "--temp", "0"], "Hi there\nAnd more\n");
    assert_eq!(code, 0, "{err}");
    let prompts: Vec<usize> = format!("{out}{err}")
        .split("[prompt ")
        .skip(1)
        .map(|r| r.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(prompts.len(), 2, "{out}{err}");
    let count = |markup: &str| {
        let (code, out, err) = waste(&["tokenize", m, "--markup", "--json", "-"], markup);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v.as_array().or_else(|| v["ids"].as_array()).unwrap().len()
    };
    let first = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>";
    assert_eq!(prompts[0], 1 + count(first), "BOS and the first rendering");
    let next = "<|im_user|>user<|im_middle|>And more<|im_end|><|im_assistant|>assistant<|im_middle|>";
    assert_eq!(prompts[1], count(next), "the follow-up turn alone");
    std::fs::remove_dir_all(&d).ok();
}

/// llama.cpp's `-m MODEL` and `-p TEXT` (and `--model=`, `--prompt=`) give
/// what the positionals give, in any order; twice is refused by clap.
#[test]
fn model_and_prompt_flags_as_llama_cpp_spells_them() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let base = ["-n", "4", "--temp", "0", "--json"];
    let run = |args: &[&str]| {
        let (code, out, err) = waste(args, "");
        assert_eq!(code, 0, "{args:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["tokens"].clone()
    };
    let want = run(&[&["run", m, "Hello there"][..], &base].concat());
    assert!(want.as_array().is_some_and(|t| !t.is_empty()), "{want}");
    let model_eq = format!("--model={m}");
    for args in [
        vec!["run", "-m", m, "-p", "Hello there"],
        vec!["run", "-p", "Hello there", "--model", m],
        vec!["run", m, "-p", "Hello there"],
        vec!["run", &model_eq, "--prompt=Hello there"],
    ] {
        assert_eq!(run(&[&args[..], &base].concat()), want, "{args:?}");
    }
    let (code, _, err) = waste(&["run", "-m", m, "-p", "a", "-p", "b"], "");
    assert_eq!(code, 2, "{err}");
    // `eval -p` and `info -m` too
    let (code, out, err) = waste(&["info", "-m", m], "");
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("kimi_linear"), "{out}");
}

/// `--fast` computes in the fast numeric mode (other logits than `exact`'s,
/// the same top token on the anchor); without a flag the mode is
/// `WASTE_NUMERIC`'s, else this CPU's default (what `version --json`
/// names); `bench --json` names the mode in use; `--fast --exact` and an
/// unknown `WASTE_NUMERIC` are refused.
#[test]
fn the_numeric_mode_is_chosen_by_flags_and_reported() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let top = |extra: &[&str], env: Option<&str>| {
        let (code, out, err) =
            waste_numeric(&[&["eval", m, "--ids", "305,10,20,30", "--json", "--top", "1"][..], extra].concat(), env);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (v["top"][0]["id"].as_u64().unwrap(), v["top"][0]["logit"].as_f64().unwrap())
    };
    let (exact, fast) = (top(&["--exact"], None), top(&["--fast"], None));
    assert_eq!(exact.0, fast.0, "the top token");
    assert_ne!(exact.1, fast.1, "the fast mode computed as exact");
    assert!((exact.1 - fast.1).abs() < 0.05 * exact.1.abs(), "{exact:?} {fast:?}");
    let (code, out, err) = waste_numeric(&["version", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let here = serde_json::from_str::<serde_json::Value>(&out).unwrap()["numeric_mode"].as_str().unwrap().to_string();
    assert_eq!(here, waste_model::build_info().numeric, "{out}");
    assert_eq!(top(&[], None), if here == "fast" { fast } else { exact }, "the default ({here})");
    assert_eq!(top(&[], Some("exact")), exact);
    assert_eq!(top(&[], Some("fast")), fast);
    assert_eq!(top(&["--exact"], Some("fast")), exact, "a flag wins over WASTE_NUMERIC");
    let (code, _, err) = waste_numeric(&["eval", m, "--ids", "305"], Some("fastest"));
    assert!(code != 0 && err.contains("WASTE_NUMERIC=fastest: expected exact or fast"), "{err}");
    for (flags, name) in [(&["--fast"][..], "fast"), (&["--exact"], "exact"), (&[], &here)] {
        let (code, out, err) =
            waste_numeric(&[&["bench", m, "-n", "1", "--json", "--prefill-repeats", "0"][..], flags].concat(), None);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["numeric_mode"], *name, "{flags:?}: {out}");
    }
    let (code, _, err) = waste(&["run", m, "hi", "--fast", "--exact"], "");
    assert_eq!(code, 2, "{err}");
}

/// `bench --json`'s `avx_vnni`: whether the AVX2 fast matmat takes AVX-VNNI
/// — at the AVX2 level in the fast mode where the CPU has it, never in
/// `exact`, and not with `WASTE_AVX_VNNI=0` (plain AVX2, as on AMD); and
/// `version --json`'s, for the level in use.
#[test]
fn bench_reports_whether_the_avx2_matmat_takes_avx_vnni() {
    let a = anchor();
    let m = a.to_str().unwrap();
    #[cfg(target_arch = "x86_64")]
    let vnni = std::arch::is_x86_feature_detected!("avxvnni");
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    let avx2 = avx2_level();
    // `args` at AVX2 (where the CPU has it), AVX-VNNI off or as detected: the JSON's `avx_vnni`
    let avx_vnni = |args: &[&str], off: bool| {
        let (code, out, err) = waste_in(args, "", |c| {
            if avx2 {
                c.env("WASTE_SIMD", "avx2");
            }
            if off {
                c.env("WASTE_AVX_VNNI", "0")
            } else {
                c.env_remove("WASTE_AVX_VNNI")
            }
        });
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["avx_vnni"].as_bool().unwrap_or_else(|| panic!("no avx_vnni in {out}"))
    };
    let run = |mode: &str, off: bool| avx_vnni(&["bench", m, "-n", "1", "--json", "--prefill-repeats", "0", mode], off);
    assert_eq!(run("--fast", false), avx2 && vnni, "the fast mode at AVX2");
    assert!(!run("--fast", true), "WASTE_AVX_VNNI=0");
    assert!(!run("--exact", false), "the exact mode");
    // `version` says it too, for the level in use
    assert_eq!(avx_vnni(&["version", "--json"], false), avx2 && vnni, "version");
    assert!(!avx_vnni(&["version", "--json"], true), "version, WASTE_AVX_VNNI=0");
}

/// `bench --json`'s `vq_lookup_probes_us`: at the AVX2 level in the fast
/// mode, the probes that chose the VQ lookup form (each with its three
/// forms' best times), the form `expert_kernel` names the fastest of their
/// best times together (a probe alone may be disturbed); none where
/// `WASTE_VQ_LOOKUP` fixes the form, or at another level.
#[test]
fn bench_reports_the_vq_lookup_probes() {
    let a = anchor();
    let m = a.to_str().unwrap();
    if !avx2_level() {
        skip::report_skip("the AVX2 VQ lookup probes (no AVX2 here)", cfg!(target_arch = "x86_64"));
        return;
    }
    let bench = |fixed: Option<&str>, level: &str| {
        let (code, out, err) =
            waste_in(&["bench", m, "-n", "1", "--json", "--prefill-repeats", "0", "--fast"], "", |c| {
                c.env("WASTE_SIMD", level);
                match fixed {
                    Some(f) => c.env("WASTE_VQ_LOOKUP", f),
                    None => c.env_remove("WASTE_VQ_LOOKUP"),
                }
            });
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let v = bench(None, "avx2");
    let probes = v["vq_lookup_probes_us"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert!(!probes.is_empty() && probes.len() <= 8, "{v}");
    let forms = [
        ("blends", "avx2-int8-pshufb-blends"),
        ("chains", "avx2-int8-pshufb-chains"),
        ("gathers", "avx2-int16-gathers"),
    ];
    let best: Vec<f64> = forms
        .iter()
        .map(|(f, _)| {
            probes.iter().map(|p| p[f].as_f64().unwrap_or_else(|| panic!("{p}"))).fold(f64::INFINITY, f64::min)
        })
        .collect();
    assert!(best.iter().all(|&t| t > 0.0 && t.is_finite()), "{v}");
    // and two inputs' rows by the pair kernel, which decides whether a
    // chunk's tokens share the gathers
    assert!(probes.iter().all(|p| p["pairs"].as_f64().is_some_and(|t| t > 0.0)), "{v}");
    // and four inputs' by the quad kernel (whether four tokens share them)
    assert!(probes.iter().all(|p| p["quads"].as_f64().is_some_and(|t| t > 0.0)), "{v}");
    let named = v["expert_kernel"].as_str().unwrap_or_else(|| panic!("{v}"));
    let i = forms.iter().position(|(_, k)| named == format!("vq3r fast {k}")).unwrap_or_else(|| panic!("{named}"));
    // the named form's best is the least (to the report's 0.1 µs)
    assert!(best.iter().all(|&t| best[i] <= t + 0.1), "{named} against {best:?}");
    // a form fixed by the environment: no probe runs, the form is that one
    let v = bench(Some("chains"), "avx2");
    assert_eq!(v["vq_lookup_probes_us"], serde_json::json!([]), "{v}");
    assert_eq!(v["expert_kernel"], "vq3r fast avx2-int8-pshufb-chains", "{v}");
}

/// Whether this CPU has the engine's AVX2 level (AVX2, FMA and F16C).
fn avx2_level() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    false
}
