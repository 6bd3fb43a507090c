//! A session that a failed step left partly updated answers
//! WASTE_E_INCOMPLETE (it said WASTE_E_ARG: nothing was wrong with the
//! arguments) until it is reset; the failed step itself says what failed.
//! The anchor container with every expert record of layer 2 damaged, opened
//! with `verify_records` (CRC on every read).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use waste::*;

fn last_error() -> String {
    // SAFETY: waste_last_error returns a valid C string.
    unsafe { CStr::from_ptr(waste_last_error()) }.to_string_lossy().into_owned()
}

fn damaged_copy(tag: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste");
    let d = std::env::temp_dir().join(format!("waste-capi-broken-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    let bank = d.join("experts-L2.bin");
    let mut b = std::fs::read(&bank).unwrap();
    for e in 0..8 {
        b[e * 12288 + 500] ^= 0x10;
    }
    std::fs::write(&bank, b).unwrap();
    d
}

/// [`damaged_copy`] opened with `verify_records`: (its directory, the model).
fn open_damaged(tag: &str) -> (PathBuf, *mut waste_model) {
    let dir = damaged_copy(tag);
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: the options and the out pointer are live locals.
    unsafe {
        let mut o = std::mem::zeroed::<waste_options>();
        waste_options_init(&mut o);
        o.verify_records = 1;
        let mut m = std::ptr::null_mut();
        assert_eq!(waste_open(path.as_ptr(), &o, &mut m), waste_status::WASTE_OK, "{}", last_error());
        (dir, m)
    }
}

#[test]
fn a_session_broken_by_a_failed_step_says_incomplete_until_reset() {
    let (dir, m) = open_damaged("eval");
    // SAFETY: every pointer below is a live local or what the library returned.
    unsafe {
        let mut s = std::ptr::null_mut();
        assert_eq!(waste_session_new(m, &mut s), waste_status::WASTE_OK);
        let ids: Vec<u32> = (1..40).collect();
        let (mut logits, mut n) = (std::ptr::null(), 0usize);
        let first = waste_eval(s, ids.as_ptr(), ids.len(), &mut logits, &mut n);
        assert_eq!(first, waste_status::WASTE_E_FORMAT, "{}", last_error());
        assert!(last_error().contains("layer 2"), "{}", last_error());
        let again = waste_eval(s, ids.as_ptr(), 1, &mut logits, &mut n);
        assert_eq!(again, waste_status::WASTE_E_INCOMPLETE, "{}", last_error());
        // reset: usable again (the first token reaches no damaged expert of
        // layer 2 only if routing says so; a fresh step is at least accepted
        // as a step, not refused as incomplete)
        assert_eq!(waste_session_reset(s), waste_status::WASTE_OK);
        let after = waste_eval(s, ids.as_ptr(), 1, &mut logits, &mut n);
        assert_ne!(after, waste_status::WASTE_E_INCOMPLETE, "{}", last_error());
        waste_session_free(s);
        waste_close(m);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `waste_step_many` refuses a session listed twice, a NULL one and a
/// mismatched count before anything runs; a failed batched step leaves
/// every listed session incomplete.
#[test]
fn a_batched_step_checks_its_sessions_and_a_failed_one_breaks_them_all() {
    let (dir, m) = open_damaged("step");
    // SAFETY: every pointer below is a live local or what the library returned.
    unsafe {
        assert!(waste_max_batch(m) >= 2);
        let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(waste_session_new(m, &mut a), waste_status::WASTE_OK);
        assert_eq!(waste_session_new(m, &mut b), waste_status::WASTE_OK);
        let ids = [5u32, 6];
        let twice = [a, a];
        assert_eq!(waste_step_many(twice.as_ptr(), 2, ids.as_ptr()), waste_status::WASTE_E_ARG);
        assert!(last_error().contains("listed twice"), "{}", last_error());
        let null = [a, std::ptr::null_mut()];
        assert_eq!(waste_step_many(null.as_ptr(), 2, ids.as_ptr()), waste_status::WASTE_E_ARG);
        assert!(last_error().contains("session 1 is NULL"), "{}", last_error());
        assert_eq!(waste_step_many(twice.as_ptr(), 0, ids.as_ptr()), waste_status::WASTE_E_ARG);
        assert_eq!(waste_session_position(a), 0, "a refused step changes nothing");
        // every layer-2 record is damaged: the step fails there, for both
        let pair = [a, b];
        let st = waste_step_many(pair.as_ptr(), 2, ids.as_ptr());
        assert_eq!(st, waste_status::WASTE_E_FORMAT, "{}", last_error());
        let (mut logits, mut n) = (std::ptr::null(), 0usize);
        for s in pair {
            assert_eq!(waste_eval(s, ids.as_ptr(), 1, &mut logits, &mut n), waste_status::WASTE_E_INCOMPLETE);
            waste_session_free(s);
        }
        waste_close(m);
    }
    std::fs::remove_dir_all(&dir).ok();
}
