//! Careless and hostile use of the `waste` binary: every case is a precise
//! error or a quiet success, never a panic (exit 101), an abort or a hang.

mod common;

use common::{anchor, copy_anchor, damage_layer2, fixtures, start, waste};
use std::io::{Read, Write};
use std::process::{Command, Stdio};

#[test]
fn huge_contexts_are_precise_errors() {
    let a = anchor();
    let a = a.to_str().unwrap();
    for ctx in ["4611686018427387904", "461168601842738790", "16777217"] {
        for cmd in [vec!["plan", a, "--ctx", ctx, "--json"], vec!["eval", a, "--ids", "1", "--ctx", ctx]] {
            let (code, _, err) = waste(&cmd, "");
            assert_eq!(code, 1, "{cmd:?}: {err}");
            assert!(err.contains("ctx") && err.contains("16777216") && !err.contains("panicked"), "{cmd:?}: {err}");
        }
    }
}

#[test]
fn absurd_thread_counts_are_capped_with_a_warning() {
    let a = anchor();
    let (code, out, err) =
        waste(&["eval", a.to_str().unwrap(), "--ids", "1,2", "--threads", "100000", "--io-threads", "100000"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("compute threads capped") && err.contains("I/O threads capped"), "{err}");
    assert!(!out.is_empty());
    // bench probes the disk with its reader count before opening: capped too
    // (it used to spawn 100 000 probe threads and abort)
    let (code, out, err) = waste(&["bench", a.to_str().unwrap(), "-n", "1", "--io-threads", "100000", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["io_threads"], 64, "{out}");
}

/// `diskbench` with reads in flight or record sizes out of range: a
/// one-line error naming the range (it used to abort spawning 100 000
/// threads, or panic on a record size that overflows when rounded), and
/// what it reports is what it read (the record rounded up to 4 KiB).
#[test]
fn diskbench_arguments_out_of_range_are_precise_errors() {
    let bank = anchor().join("experts-L1.bin");
    let b = bank.to_str().unwrap();
    for (args, want) in [
        (vec!["--qd", "0"], "expected 1 to 64"),
        (vec!["--qd", "100000"], "expected 1 to 64"),
        (vec!["--record-size", "18446744073709551615"], "exceed the probe's 1024 MiB"),
        (vec!["--record-size", "536870912", "--qd", "4"], "exceed the probe's 1024 MiB"),
    ] {
        let mut cmd = vec!["diskbench", b];
        cmd.extend(&args);
        let (code, _, err) = waste(&cmd, "");
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(want) && err.trim().lines().count() == 1, "{args:?}: {err}");
    }
    let (code, out, err) = waste(&["diskbench", b, "--record-size", "1", "--qd", "2", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((v["record_size"].as_u64(), v["qd"].as_u64()), (Some(4096), Some(2)), "{out}");
}

/// `bench` with no decode step to time is an error naming the option (it
/// reported 0 tok/s, "0.0 ms/token" and a roofline share in the thousands
/// as if measured); a context that fills before `-n` steps is a warning,
/// and the JSON counts the steps actually timed.
#[test]
fn bench_without_a_decode_step_is_an_error() {
    let a = anchor();
    let a = a.to_str().unwrap();
    for (args, want) in [
        (vec!["-n", "0"], "-n 0"),
        (vec!["--prompt-len", "0"], "--prompt-len 0"),
        (vec!["--ctx", "8", "--prompt-len", "8"], "leaves no room to decode in a context of 8"),
    ] {
        let mut cmd = vec!["bench", a, "--json"];
        cmd.extend(&args);
        let (code, out, err) = waste(&cmd, "");
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(want) && out.is_empty(), "{args:?}: {err}");
    }
    let (code, out, err) = waste(&["bench", a, "--ctx", "12", "--prompt-len", "8", "-n", "10", "--json"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("decoded 4 of 10 steps"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["decode_tokens"], 4, "{out}");
}

/// Text inputs are bounded: a device given as a prompt or schema file is
/// refused at once (`/dev/zero` was read until memory ran out); a prompt
/// longer than the context can hold whatever its tokens is refused before
/// tokenizing (a 300 MB prompt took 27 s and 9.7 GB before); one that
/// tokenizes past the context is refused before any of it is evaluated
/// (it was evaluated in steps until the context was full).
#[test]
fn text_inputs_that_cannot_fit_are_refused_up_front() {
    let a = anchor();
    let a = a.to_str().unwrap();
    for (flag, extra) in [("--file", vec![]), ("--json-schema", vec!["hi"])] {
        let mut cmd = vec!["run", a, flag, "/dev/zero", "-n", "1"];
        cmd.extend(extra);
        let (code, _, err) = waste(&cmd, "");
        assert_eq!(code, 1, "{flag}: {err}");
        assert!(err.contains("/dev/zero: not a regular file"), "{flag}: {err}");
    }
    let long = "a".repeat(2000);
    let (code, _, err) = waste(&["run", a, "--raw", "--ctx", "16", "-n", "1", &long], "");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("the text is 2000 bytes: more than a context of 16 tokens can hold"), "{err}");
    // 150 plain tokens into a context of 100: the whole prompt is refused
    let prompt = "b".repeat(150);
    let (code, _, err) = waste(&["run", a, "--raw", "--ctx", "100", "-n", "1", "-"], &prompt);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("context full: 0 + "), "{err}");
}

/// An explicitly empty API key (`--api-key "$UNSET"`) is refused before
/// the model is opened: it was dropped, and the server ran without a key.
#[test]
fn an_empty_api_key_and_useless_limits_are_refused() {
    for key in ["", "  "] {
        let (code, _, err) = waste(&["serve", anchor().to_str().unwrap(), "--port", "0", "--api-key", key], "");
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("--api-key is empty"), "{err}");
    }
    // limits under which the server would refuse or empty every answer (it
    // started, then answered every request with 503 queue_full, 413, or "")
    for (flag, v) in [("--max-queue", "0"), ("--max-tokens", "0"), ("--body-limit", "10"), ("--max-connections", "0")] {
        let (code, _, err) = waste(&["serve", anchor().to_str().unwrap(), "--port", "0", flag, v], "");
        assert_eq!(code, 1, "{flag}: {err}");
        assert!(err.contains(&format!("{flag} {v}: at least")), "{flag}: {err}");
    }
    // a timeout of 0 is refused before the model is opened (a large model
    // took its whole open first): a path that does not exist is never read
    let missing = std::env::temp_dir().join("waste-no-such-model.waste");
    for flag in ["--idle-timeout", "--header-timeout", "--body-timeout"] {
        let (code, _, err) = waste(&["serve", missing.to_str().unwrap(), "--port", "0", flag, "0"], "");
        assert_eq!(code, 1, "{flag}: {err}");
        assert!(err.contains(&format!("{flag} 0: expected seconds")), "{flag}: {err}");
    }
}

/// Sampling flags out of range, an empty stop string, a routing trace
/// that is not one and an eval that would print nothing are refused before
/// the model is opened (they were refused when generation began: after the
/// open and the whole prompt's prefill): a path that does not exist is
/// never read.
#[test]
fn bad_sampling_flags_are_refused_before_the_open() {
    let missing = std::env::temp_dir().join("waste-no-such-model.waste");
    let m = missing.to_str().unwrap();
    let junk = std::env::temp_dir().join(format!("waste-not-a-trace-{}.jsonl", std::process::id()));
    std::fs::write(&junk, "not a trace\n").unwrap();
    let j = junk.to_str().unwrap();
    for (args, says) in [
        (&["run", m, "hi", "--top-p", "2"][..], "top_p 2 must be in (0, 1]"),
        (&["run", m, "hi", "--min-p", "1.5"][..], "min_p 1.5 must be in [0, 1]"),
        (&["run", m, "hi", "--temp", "inf"][..], "temperature inf must be finite"),
        (&["run", m, "hi", "--stop", ""][..], "a stop string is empty"),
        (&["chat", m, "--top-p", "0"][..], "top_p 0 must be in (0, 1]"),
        (&["bench", m, "--temp", "nan"][..], "--temp: temperature NaN"),
        (&["bench", m, "--routing", j][..], "not-a-trace"),
        (&["bench", m, "--parallel", "2", "--routing", j][..], "not-a-trace"),
        (&["eval", m, "--ids", "1", "--top", "0"][..], "--top 0 would print nothing"),
    ] {
        let (code, _, err) = waste(args, "");
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(says) && !err.contains("no-such-model"), "{args:?}: {err}");
    }
    std::fs::remove_file(&junk).ok();
}

/// `chat` reads a line at most as long as any text input: an endless line
/// on stdin (`/dev/zero`) is an error, where it grew to 7 GB in 10 s.
#[cfg(unix)]
#[test]
fn an_endless_chat_line_is_an_error() {
    let o = Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["chat", anchor().to_str().unwrap(), "-n", "1"])
        .stdin(std::fs::File::open("/dev/zero").unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("a line of more than 256 MiB on stdin"), "{err}");
}

/// A second server on a taken port says which address it could not
/// listen on (it printed "Address already in use (os error 98)" alone).
#[test]
fn a_taken_port_names_the_address() {
    let s = start(&[]);
    let port = s.port.to_string();
    let (code, _, err) = waste(&["serve", anchor().to_str().unwrap(), "--port", &port], "");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&format!("listening on 127.0.0.1:{port}")), "{err}");
}

#[test]
fn a_closed_pipe_ends_output_quietly() {
    let a = anchor();
    let text = "streaming experts ".repeat(20_000);
    let mut c = Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["tokenize", a.to_str().unwrap(), "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = c.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let mut first = [0u8; 10];
    c.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    drop(c.stdout.take()); // `| head -c 10`
    let mut err = String::new();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let st = c.wait().unwrap();
    feeder.join().unwrap().unwrap();
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_failed_save_or_load_keeps_the_conversation() {
    let a = anchor();
    let d = std::env::temp_dir().join(format!("waste-hard-save-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let zero = d.join("zero.state");
    let _ = std::fs::remove_file(&zero);
    #[cfg(unix)]
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let input = format!(
        "hello\n/save {}\n/save {}\n/load {}\n/stats\nagain\n/save {}\n",
        d.join("no/such/dir/x.state").display(),
        d.display(),
        zero.display(),
        d.join("ok.state").display()
    );
    let (code, _, err) = waste(&["chat", a.to_str().unwrap(), "-n", "3", "--temp", "0"], &input);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("(the conversation is kept)").count(), 3, "{err}");
    // the conversation went on after the failures, and a good save still works
    assert!(err.contains("[position"), "{err}");
    assert!(d.join("ok.state").exists(), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

/// Options that would do nothing say so: `--system` and `--think` with no
/// chat template (`--raw`, `--ids`) are refused; `--think` on a model
/// whose template has no thinking mode (a Jinja template here) is a
/// warning. All three were silently ignored.
#[test]
fn options_without_effect_are_refused_or_warned() {
    let a = anchor();
    let a = a.to_str().unwrap();
    for args in
        [vec!["hi", "--raw", "--system", "s"], vec!["--ids", "1", "--system", "s"], vec!["--ids", "1", "--think"]]
    {
        let mut cmd = vec!["run", a, "-n", "1"];
        cmd.extend(&args);
        let (code, _, err) = waste(&cmd, "");
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("cannot be used with"), "{args:?}: {err}");
    }
    let d = copy_anchor("jinja");
    std::fs::write(d.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let (code, _, err) = waste(&["run", d.to_str().unwrap(), "hi", "--think", "-n", "1"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("warning: --think has no effect"), "{err}");
    let (_, _, err) = waste(&["run", a, "hi", "--think", "-n", "1"], "");
    assert!(!err.contains("--think has no effect"), "the anchor's tagged format thinks: {err}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_hostile_chat_template_is_an_error_naming_the_file() {
    let d = copy_anchor("template");
    std::fs::write(
        d.join("chat_template.jinja"),
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let (code, _, err) = waste(&["run", d.to_str().unwrap(), "hi", "-n", "1"], "");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("chat_template.jinja") && !err.contains("panicked"), "{err}");
    // deep recursion too
    std::fs::write(d.join("chat_template.jinja"), "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").unwrap();
    let (code, _, err) = waste(&["run", d.to_str().unwrap(), "hi", "-n", "1"], "");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("chat_template.jinja"), "{err}");
    // a value grown without being written (a string doubled 40 times) and a
    // loop of 100 MB repetitions: minijinja's fuel bounds neither, and the
    // first ended the process on a failed allocation; rendered in a limited
    // child, both are an error naming the file, in the command's own words
    for hostile in [
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% macro f(s, n) %}{% if n < 30 %}{{ f(s ~ s, n + 1) }}{% endif %}{% endmacro %}{{ f('xxxxxxxxxxxxxxxx', 0) }}",
        "{% for i in range(100) %}{{ 'x' * 100000000 }}{% endfor %}",
    ] {
        std::fs::write(d.join("chat_template.jinja"), hostile).unwrap();
        let (code, _, err) = waste(&["run", d.to_str().unwrap(), "hi", "-n", "1"], "");
        assert_eq!(code, 1, "{hostile}: {err}");
        assert!(err.starts_with("error: ") && err.contains("chat_template.jinja"), "{hostile}: {err}");
    }
    // a manifest that is a device, not a file
    #[cfg(unix)]
    {
        std::fs::remove_file(d.join("manifest.json")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("manifest.json")).unwrap();
        let (code, _, err) = waste(&["info", d.to_str().unwrap()], "");
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("manifest.json") && err.contains("not a regular file"), "{err}");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// A chat turn the engine cannot finish (every record of layer 2 damaged,
/// read with `--verify`) is reported with its cause, the conversation is
/// reset, and the REPL goes on to the next command instead of exiting.
#[test]
fn a_failed_chat_turn_is_reported_and_the_repl_goes_on() {
    let d = copy_anchor("chatfail");
    damage_layer2(&d);
    let m = d.to_str().unwrap();
    let (code, _, err) = waste(&["chat", m, "-n", "4", "--verify"], "hello there\n/stats\nagain\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("the conversation was reset").count(), 2, "{err}");
    assert!(err.contains("checksum mismatch") && err.contains("layer 2"), "{err}");
    assert!(err.contains("[position 0 /"), "/stats after the failed turn: {err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

/// An error's OS cause is said once: the engine's errors carry it in their
/// own message, and the CLI's chain printing used to repeat it ("…: No such
/// file or directory (os error 2): No such file or directory (os error 2)").
/// A `--usage` file that cannot be used is a warning naming it.
#[test]
fn errors_say_their_cause_once_and_a_bad_usage_file_is_named() {
    let (code, _, err) = waste(&["info", "/nonexistent-container"], "");
    assert_eq!(code, 1, "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    let a = anchor();
    let (code, _, err) = waste(&["eval", a.to_str().unwrap(), "--ids", "1", "--usage", "/nonexistent-usage"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("warning: usage file /nonexistent-usage: not read"), "{err}");
}

/// `convert --head`: q4 stores the head as Q4G (and says so in `info
/// --json`'s tensor list); a format it does not know is a one-line error
/// naming the choices, before anything is written.
#[test]
fn convert_head_takes_q8_or_q4_and_refuses_the_rest() {
    let src = fixtures().join("hf-tiny");
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("head-q4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    let (code, _, err) = waste(&["convert", "--src", s, "--out", o, "--experts", "f16", "--head", "q6", "-q"], "");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--head \"q6\": expected q8 or q4") && err.trim().lines().count() == 1, "{err}");
    assert!(!out.exists() && !waste_convert::staging_dir(&out).exists());
    let (code, _, err) = waste(&["convert", "--src", s, "--out", o, "--experts", "f16", "--head", "q4", "-q"], "");
    assert_eq!(code, 0, "{err}");
    let c = waste_model::format::Container::open(&out).unwrap();
    assert_eq!(c.tensors["lm_head.weight"].fmt, waste_model::format::Fmt::Q4G);
    assert_eq!(c.tensors["model.embed_tokens.weight"].fmt, waste_model::format::Fmt::Q8G);
    std::fs::remove_dir_all(&out).ok();
}
