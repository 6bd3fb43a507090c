//! Damaged copies of the C WASTE's anchor container: each kind of damage
//! gives a precise error (naming the key, tensor, layer or expert), never a
//! panic or an out-of-bounds read.

use serde_json::Value;
use std::path::{Path, PathBuf};
use waste_format::Container;

fn anchor() -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    let p = base.join("anchor-tiny/kimi-linear-tiny.waste");
    assert!(p.join("manifest.json").exists(), "test data missing at {} (testdata/ in the repository)", p.display());
    p
}

fn copy(tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("waste-damage-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(anchor()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        let mut perm = std::fs::metadata(dst.join(e.file_name())).unwrap().permissions();
        #[allow(clippy::permissions_set_readonly_false)]
        perm.set_readonly(false);
        std::fs::set_permissions(dst.join(e.file_name()), perm).unwrap();
    }
    dst
}

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("manifest.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn poke(path: &Path, off: usize, f: impl FnOnce(&mut u8)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b[off]);
    std::fs::write(path, b).unwrap();
}

/// Open-time failure whose message contains every `needle`.
fn open_err(dir: &Path, needles: &[&str]) {
    let e = Container::open(dir).expect_err("damaged container opened").to_string();
    for n in needles {
        assert!(e.contains(n), "error {e:?} lacks {n:?}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Verify-time failure: the container opens, verify lists the problem.
fn verify_problem(dir: &Path, needles: &[&str]) {
    let rep = waste_model::verify(dir, Default::default(), &|_, _| {}).unwrap();
    assert_eq!(rep.problems.len(), 1, "{:?}", rep.problems);
    for n in needles {
        assert!(rep.problems[0].contains(n), "problem {:?} lacks {n:?}", rep.problems[0]);
    }
    std::fs::remove_dir_all(dir).ok();
}

const REC: usize = 12288;

#[test]
fn pristine_anchor_verifies() {
    let rep = waste_model::verify(&anchor(), Default::default(), &|_, _| {}).unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
    assert_eq!(rep.records, 24);
    let m: Value = serde_json::from_slice(&std::fs::read(anchor().join("manifest.json")).unwrap()).unwrap();
    assert_eq!(rep.tensors, m["trunk"].as_array().unwrap().len() as u64);
}

/// A caller's thread count and read size are bounded: more reads in flight
/// than reader threads allowed, or a read above `MAX_VERIFY_READ`, is an
/// argument error naming the option; the bounds themselves still verify.
#[test]
fn verify_bounds_reads_in_flight_and_read_size() {
    use waste_model::{VerifyOptions, MAX_IO_THREADS, MAX_VERIFY_READ};
    let run = |o: VerifyOptions| waste_model::verify(&anchor(), o, &|_, _| {});
    let d = VerifyOptions::default();
    let e = run(VerifyOptions { queue_depth: MAX_IO_THREADS + 1, ..d }).unwrap_err();
    assert!(matches!(e, waste_model::Error::Arg(ref m) if m.contains("queue_depth")), "{e}");
    let e = run(VerifyOptions { records_per_read: MAX_VERIFY_READ / REC + 1, ..d }).unwrap_err();
    assert!(matches!(e, waste_model::Error::Arg(ref m) if m.contains("records_per_read")), "{e}");
    let rep = run(VerifyOptions { queue_depth: MAX_IO_THREADS, records_per_read: MAX_VERIFY_READ / REC, ..d }).unwrap();
    assert!(rep.problems.is_empty() && rep.records == 24, "{:?}", rep.problems);
}

#[test]
fn flipped_payload_byte_is_a_checksum_mismatch_naming_the_expert() {
    let d = copy("payload");
    poke(&d.join("experts-L2.bin"), 3 * REC + 500, |b| *b ^= 0x10);
    verify_problem(&d, &["expert 3 of layer 2", "checksum mismatch"]);
}

#[test]
fn flipped_scale_byte_is_caught_by_the_crc() {
    let d = copy("scale");
    poke(&d.join("experts-L1.bin"), 5 * REC + 9264 + 7, |b| *b ^= 0x01);
    verify_problem(&d, &["expert 5 of layer 1", "checksum mismatch"]);
}

#[test]
fn flipped_header_byte_names_the_record() {
    let d = copy("header");
    poke(&d.join("experts-L3.bin"), 6 * REC + 6, |b| *b ^= 0x01); // expert_id 6 -> 7
    verify_problem(&d, &["expert 6 of layer 3", "misplaced"]);
}

#[test]
fn wrong_magic() {
    let d = copy("magic");
    poke(&d.join("experts-L1.bin"), 0, |b| *b = b'X');
    verify_problem(&d, &["expert 0 of layer 1", "bad magic"]);
}

#[test]
fn fmt_byte_disagreeing_with_the_manifest() {
    let d = copy("fmtbyte");
    poke(&d.join("experts-L2.bin"), REC + 8, |b| *b = 8); // VQ4P byte in a VQ3R container
    verify_problem(&d, &["expert 1 of layer 2", "fmt byte 8", "VQ3R"]);
}

#[test]
fn codebook_id_out_of_range_in_a_record() {
    let d = copy("cbid");
    poke(&d.join("experts-L1.bin"), 2 * REC + 10, |b| *b = 200);
    verify_problem(&d, &["expert 2 of layer 1", "codebook_id 200"]);
}

#[test]
fn truncated_bank() {
    let d = copy("trunc");
    let p = d.join("experts-L2.bin");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - REC / 2]).unwrap();
    open_err(&d, &["layer 2", "truncated", "7 of 8 records"]);
}

#[test]
fn bank_with_one_record_too_few() {
    let d = copy("fewer");
    edit_manifest(&d, |m| m["layers"]["1"]["experts"] = 7.into());
    open_err(&d, &["layer 1", "7 experts", "config has 8"]);
}

#[test]
fn huge_dimension() {
    let d = copy("huge");
    edit_manifest(&d, |m| m["config"]["hidden_size"] = Value::from(1u64 << 40));
    open_err(&d, &["config.hidden_size", "1099511627776"]);
}

#[test]
fn negative_offset() {
    let d = copy("neg");
    edit_manifest(&d, |m| m["trunk"][3]["off"] = Value::from(-4096));
    open_err(&d, &["trunk[3]", "q_proj", "-4096"]);
}

#[test]
fn overflowing_offset() {
    let d = copy("ovf");
    edit_manifest(&d, |m| m["trunk"][5]["off"] = Value::from(u64::MAX - 10));
    open_err(&d, &["model.layers.0.self_attn.v_proj.weight", "overflows"]);
}

#[test]
fn offset_beyond_the_file() {
    let d = copy("beyond");
    edit_manifest(&d, |m| m["trunk"][5]["off"] = Value::from(400_000u64));
    open_err(&d, &["v_proj", "beyond trunk.bin"]);
}

#[test]
fn missing_tensor() {
    let d = copy("missing");
    edit_manifest(&d, |m| {
        let t = m["trunk"].as_array_mut().unwrap();
        t.retain(|e| e["name"] != "model.layers.2.self_attn.kv_b_proj.weight");
    });
    open_err(&d, &["model.layers.2.self_attn.kv_b_proj.weight", "missing"]);
}

#[test]
fn wrong_shape() {
    let d = copy("shape");
    edit_manifest(&d, |m| m["trunk"][3]["shape"] = serde_json::json!([64, 256]));
    open_err(&d, &["q_proj", "shape [64, 256]"]);
}

#[test]
fn wrong_format_version() {
    let d = copy("fv");
    edit_manifest(&d, |m| m["format_version"] = 1.into());
    open_err(&d, &["format_version", "1 is not supported"]);
}

#[test]
fn missing_format_version() {
    let d = copy("nofv");
    edit_manifest(&d, |m| {
        m.as_object_mut().unwrap().remove("format_version");
    });
    open_err(&d, &["format_version", "missing"]);
}

#[test]
fn codebook_base_out_of_range() {
    let d = copy("cbbase");
    edit_manifest(&d, |m| m["layers"]["3"]["codebook_base"] = 25.into());
    open_err(&d, &["layers.3.codebook_base", "25"]);
}

#[test]
fn damaged_codebook_file() {
    let d = copy("cbfile");
    poke(&d.join("codebooks.bin"), 4112 * 4, |b| *b ^= 0xff);
    open_err(&d, &["codebook 4", "bad magic"]);
}

#[test]
fn bank_path_escaping_the_container() {
    let d = copy("escape");
    edit_manifest(&d, |m| m["layers"]["1"]["file"] = "../../etc/passwd".into());
    open_err(&d, &["layers.1.file", "not a plain file name"]);
}

#[test]
fn quant_index_bits_disagreeing_with_format() {
    let d = copy("bits");
    edit_manifest(&d, |m| m["expert_quant"]["index_bits"] = 6.into());
    open_err(&d, &["expert_quant.index_bits", "6"]);
}

#[test]
fn not_json() {
    let d = copy("json");
    std::fs::write(d.join("manifest.json"), b"{\"format_version\": 0, \"trunk\": [").unwrap();
    open_err(&d, &["manifest.json", "invalid JSON"]);
}

/// Byte offset and element count of a trunk tensor's payload, or of its
/// scales (`scales`), from the manifest.
fn trunk_span(dir: &Path, name: &str, scales: bool) -> (usize, usize) {
    let m: Value = serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let t = m["trunk"].as_array().unwrap().iter().find(|t| t["name"] == name).expect("tensor in the manifest");
    let key = if scales { "scale_off" } else { "off" };
    let elems: u64 = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product();
    (t[key].as_u64().unwrap() as usize, elems as usize)
}

/// Overwrite little-endian f32s at byte `off` of a file.
fn put_f32s(path: &Path, off: usize, vals: &[f32]) {
    let mut b = std::fs::read(path).unwrap();
    for (i, v) in vals.iter().enumerate() {
        b[off + 4 * i..off + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, b).unwrap();
}

fn model_err(dir: &Path, needles: &[&str]) {
    let opts = waste_model::ModelOptions { ctx: 64, threads: 1, ..waste_model::ModelOptions::exact() };
    let e = waste_model::Model::open(dir, opts).err().expect("damaged container opened").to_string();
    for n in needles {
        assert!(e.contains(n), "error {e:?} lacks {n:?}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn non_finite_trunk_scale_names_the_tensor_at_open() {
    let d = copy("nanscale");
    let (off, _) = trunk_span(&d, "model.layers.1.self_attn.o_proj.weight", true);
    // row 1's only group: an f16 NaN
    poke(&d.join("trunk.bin"), off + 3, |b| *b = 0x7e);
    poke(&d.join("trunk.bin"), off + 2, |b| *b = 0x00);
    model_err(&d, &["model.layers.1.self_attn.o_proj.weight", "scale group 0 of row 1 is not finite", "0x7e00"]);
}

#[test]
fn infinite_f32_weight_names_the_tensor_at_open() {
    let d = copy("inff32");
    let (off, _) = trunk_span(&d, "model.layers.0.input_layernorm.weight", false);
    put_f32s(&d.join("trunk.bin"), off + 4 * 5, &[f32::NEG_INFINITY]);
    model_err(&d, &["model.layers.0.input_layernorm.weight", "column 5 of row 0 is not finite"]);
}

#[test]
fn non_finite_codebook_entry_names_the_codebook() {
    let d = copy("nancb");
    // codebook 2, entry 7, element 3 (16-byte header, 8 f16 per entry): +inf
    let at = 4112 * 2 + 16 + (7 * 8 + 3) * 2;
    poke(&d.join("codebooks.bin"), at, |b| *b = 0x00);
    poke(&d.join("codebooks.bin"), at + 1, |b| *b = 0x7c);
    open_err(&d, &["codebook 2", "entry 7 (element 3) is not finite", "0x7c00"]);
}

/// A tokenizer that can produce an id the model has no row for (a special
/// past the vocabulary), or that gives one id to two tokens, is refused at
/// open naming it — before, the first was found only when some prompt
/// produced the id, and the second decoded one token as another.
#[test]
fn an_inconsistent_tokenizer_is_refused_at_open() {
    let d = copy("tok-past-vocab");
    let p = d.join("specials.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replacen("[", "[{\"id\": 316, \"text\": \"<|extra|>\"},", 1)).unwrap();
    model_err(&d, &["tokenizer", "id 316 (\"<|extra|>\") is outside the model's vocabulary of 316"]);

    let d = copy("tok-dup-rank");
    let p = d.join("tokenizer.model");
    let text = std::fs::read_to_string(&p).unwrap();
    // line 6 takes line 5's rank
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let rank4 = lines[4].split(' ').nth(1).unwrap().to_string();
    lines[5] = format!("{} {rank4}", lines[5].split(' ').next().unwrap());
    std::fs::write(&p, lines.join("\n")).unwrap();
    model_err(&d, &["tokenizer.model", "line 6", "rank 4 was already given on line 5"]);
}

/// Weights that load (every value finite) but overflow: a norm at f32's
/// largest value. The step stops where the first non-finite value appears
/// and names it — a layer's attention or feed-forward output and its first
/// position as the step runs, or the logits at its end (the final norm) —
/// instead of sampling from NaN logits (which printed token 0 over and over
/// with a zero exit status).
#[test]
fn overflowing_weights_are_an_error_naming_where() {
    use waste_model::NonFiniteAt::{Attention, Ffn, Logit};
    for (norm, want_pos, want) in [
        ("model.norm.weight", 2, None),
        ("model.layers.1.input_layernorm.weight", 0, Some(Attention { layer: 1 })),
        ("model.layers.2.post_attention_layernorm.weight", 0, Some(Ffn { layer: 2 })),
    ] {
        let d = copy("overflow");
        let (off, n) = trunk_span(&d, norm, false);
        put_f32s(&d.join("trunk.bin"), off, &vec![f32::MAX; n]);
        expect_non_finite(&d, norm, want_pos, |at| match want {
            Some(w) => at == w,
            None => matches!(at, Logit { .. }),
        });
    }
}

/// Evaluating 3 tokens on the container `d` stops with a non-finite error
/// at `want_pos` whose place `want_at` accepts and whose message names it;
/// removes `d`.
fn expect_non_finite(d: &Path, what: &str, want_pos: usize, want_at: impl Fn(waste_model::NonFiniteAt) -> bool) {
    let m = waste_model::Model::open(
        d,
        waste_model::ModelOptions { ctx: 64, threads: 1, ..waste_model::ModelOptions::exact() },
    )
    .expect("finite weights load");
    let mut s = m.session();
    match s.eval(&[1, 2, 3]) {
        Err(e @ waste_model::Error::NonFinite { pos, at, .. }) => {
            assert_eq!(pos, want_pos, "{what}: {e}");
            assert!(want_at(at), "{what}: {e}");
            assert!(e.to_string().contains(&at.to_string()), "{e}");
        }
        other => panic!("{what}: expected a non-finite error, got {:?}", other.map(|l| l.len())),
    }
    drop(s);
    drop(m);
    std::fs::remove_dir_all(d).ok();
}

/// A hidden state that grows past what a norm can square (|x| beyond
/// ≈ 1.8e19, still finite): the reference's norm returns zeros there, and
/// the model went on to print fluent nonsense from finite logits. Here the
/// routed experts are scaled by 1e30 (a finite config value): layer 1's
/// feed-forward output is finite but huge, layer 2's input norm overflows,
/// and the step stops at layer 2's attention output.
#[test]
fn a_hidden_state_too_large_to_normalize_is_an_error() {
    let d = copy("overflow-squares");
    let p = d.join("manifest.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let edited = text.replace("\"routed_scaling_factor\": 2.0", "\"routed_scaling_factor\": 1e30");
    assert_ne!(text, edited, "the anchor's manifest changed");
    std::fs::write(&p, edited).unwrap();
    use waste_model::NonFiniteAt::Attention;
    expect_non_finite(&d, "routed_scaling_factor 1e30", 0, |at| at == Attention { layer: 2 });
}

/// `verify` checks what opening a model checks and more: every trunk
/// tensor (the embedding table included, which a model reads row by row)
/// and every record's per-row scales — a record sealed with an infinite
/// scale passes its CRC.
#[test]
fn verify_names_non_finite_trunk_values_and_record_scales() {
    let d = copy("verify-embed");
    let (off, _) = trunk_span(&d, "model.embed_tokens.weight", true);
    // row 3's scale: NaN
    poke(&d.join("trunk.bin"), off + 2 * 3 + 1, |b| *b = 0x7e);
    verify_problem(&d, &["model.embed_tokens.weight", "scale group 0 of row 3 is not finite"]);

    let d = copy("verify-scale");
    let c = Container::open(&d).unwrap();
    let lay = c.experts.as_ref().unwrap().1;
    let base = c.banks[2].as_ref().unwrap().codebook_base;
    let p = d.join("experts-L2.bin");
    let mut b = std::fs::read(&p).unwrap();
    let rec = &mut b[3 * REC..4 * REC];
    // up row 5's scale: +inf, then resealed (a valid CRC over the damage)
    let at = lay.scales_off + 2 * (lay.m + 5);
    rec[at..at + 2].copy_from_slice(&0x7C00u16.to_le_bytes());
    waste_format::seal_record(rec, 2, 3, &lay, base as u16);
    std::fs::write(&p, b).unwrap();
    verify_problem(&d, &["expert 3 of layer 2", "the up scale of row 5 is not finite (f16 0x7c00)"]);
}

/// A record sealed with an infinite scale (its CRC passes) is refused when
/// it is read, naming the expert and row — not met later as NaN logits.
#[test]
fn a_sealed_infinite_record_scale_is_refused_when_read() {
    let d = copy("read-scale");
    let c = Container::open(&d).unwrap();
    let lay = c.experts.as_ref().unwrap().1;
    let bank = c.banks[1].as_ref().unwrap();
    let (base, n) = (bank.codebook_base, bank.experts);
    let p = d.join("experts-L1.bin");
    let mut b = std::fs::read(&p).unwrap();
    for e in 0..n {
        let rec = &mut b[e * REC..(e + 1) * REC];
        // every expert's down row 7: -inf
        let at = lay.scales_off + 2 * (2 * lay.m + 7);
        rec[at..at + 2].copy_from_slice(&0xFC00u16.to_le_bytes());
        waste_format::seal_record(rec, 1, e, &lay, base as u16);
    }
    std::fs::write(&p, b).unwrap();
    let m = waste_model::Model::open(
        &d,
        waste_model::ModelOptions { ctx: 64, threads: 1, ..waste_model::ModelOptions::exact() },
    )
    .expect("the damage is inside the records");
    let e = m.session().eval(&[1, 2, 3]).expect_err("an infinite scale was used").to_string();
    assert!(e.contains("of layer 1: the down scale of row 7 is not finite (f16 0xfc00)"), "{e}");
    drop(m);
    std::fs::remove_dir_all(&d).ok();
}

/// A copy of the anchor with a payload byte of each of layer 2's 8 records
/// flipped: its directory, the bank's path and the bank's good bytes.
fn layer_2_damaged(tag: &str) -> (PathBuf, PathBuf, Vec<u8>) {
    let d = copy(tag);
    let bank = d.join("experts-L2.bin");
    let good = std::fs::read(&bank).unwrap();
    let mut bad = good.clone();
    for e in 0..8 {
        bad[e * REC + 500] ^= 0x10;
    }
    std::fs::write(&bank, &bad).unwrap();
    (d, bank, good)
}

/// A step that fails part-way (here every record of layer 2 damaged, so
/// the first token stops at that layer's experts after the layers before it
/// updated their state) leaves the session refusing to go on — even once
/// the cause is gone (the bank repaired, as a transient read error would
/// be) — until it is reset; it must never continue from the half-updated
/// state as if the failed tokens had not happened. After the reset it
/// computes exactly what a fresh session does.
#[test]
fn a_step_failed_part_way_refuses_until_reset() {
    let (d, bank, good) = layer_2_damaged("partway");
    let opts =
        waste_model::ModelOptions { ctx: 64, threads: 1, verify_records: true, ..waste_model::ModelOptions::exact() };
    let m = waste_model::Model::open(&d, opts.clone()).expect("damage inside records opens");
    let mut s = m.session();
    let e = s.eval(&[1, 2, 3]).expect_err("a damaged layer fails the step").to_string();
    assert!(e.contains("layer 2") && e.contains("checksum mismatch"), "{e}");
    std::fs::write(&bank, &good).unwrap();
    for next in [&[4u32][..], &[1, 2, 3]] {
        match s.eval(next) {
            Err(waste_model::Error::Incomplete(cause)) => assert!(cause.contains("checksum mismatch"), "{cause}"),
            other => panic!("a half-updated session went on: {:?}", other.map(|l| l.len())),
        }
    }
    assert!(s.save_state(d.join("half.state")).is_err(), "a half-updated state was saved");
    assert!(!d.join("half.state").exists());
    // a snapshot carries the mark: restoring it restores the refusal
    let half = s.snapshot();
    s.reset();
    s.restore_snapshot(&half).expect("a snapshot of this session restores");
    assert!(matches!(s.eval(&[4]), Err(waste_model::Error::Incomplete(_))), "a restored half state went on");
    s.reset();
    let after = s.eval(&[1, 2, 3, 4]).expect("the reset session works").to_vec();
    let fresh = waste_model::Model::open(&d, opts).unwrap();
    let want = fresh.session().eval(&[1, 2, 3, 4]).unwrap().to_vec();
    assert!(after.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "reset session differs from a fresh one");
    drop(s);
    drop(m);
    std::fs::remove_dir_all(&d).ok();
}

/// A damaged record met in a batched step run as two halves in turn: the
/// error names it, every session of the step refuses to go on, and the
/// halves' pinned experts are let go — with the bank mended, the reset
/// sessions step again in the same small cache and give a fresh model's
/// logits.
#[test]
fn a_damaged_record_in_a_step_of_two_halves_fails_every_session_and_leaks_no_pin() {
    let (d, bank, good) = layer_2_damaged("halves");
    let plan = waste_model::plan(&d, 64).unwrap();
    let opts = waste_model::ModelOptions {
        ctx: 64,
        threads: 1,
        verify_records: true,
        halves: Some(true),
        budget: plan.floor_bytes + 8 * plan.record_bytes,
        ..waste_model::ModelOptions::exact()
    };
    let m = waste_model::Model::open(&d, opts.clone()).expect("damage inside records opens");
    assert_eq!(m.halves(), Some(true));
    let n = m.max_batch().min(3);
    assert!(n >= 2, "{n} sequences fit a step");
    let tokens: Vec<u32> = (1..=n as u32).collect();
    let mut ss: Vec<_> = (0..n).map(|_| m.session()).collect();
    let mut refs: Vec<_> = ss.iter_mut().collect();
    let e = m.step_many(&mut refs, &tokens).expect_err("a damaged layer fails the step").to_string();
    assert!(e.contains("layer 2") && e.contains("checksum mismatch"), "{e}");
    std::fs::write(&bank, &good).unwrap();
    for s in ss.iter_mut() {
        match s.eval(&[4]) {
            Err(waste_model::Error::Incomplete(cause)) => assert!(cause.contains("checksum mismatch"), "{cause}"),
            other => panic!("a session of the failed step went on: {:?}", other.map(|l| l.len())),
        }
        s.reset();
    }
    let mut refs: Vec<_> = ss.iter_mut().collect();
    m.step_many(&mut refs, &tokens).expect("the mended batch steps: no pin was left behind");
    let fresh = waste_model::Model::open(&d, opts).unwrap();
    for (s, &t) in ss.iter().zip(&tokens) {
        let want = fresh.session().eval(&[t]).unwrap().to_vec();
        assert!(s.logits().iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t} differs from fresh");
    }
    drop(ss);
    drop(m);
    std::fs::remove_dir_all(&d).ok();
}
