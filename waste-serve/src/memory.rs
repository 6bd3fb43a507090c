//! What a request's JSON body costs once parsed, known before parsing it.
//!
//! `serde_json::Value` (with `preserve_order`, as the workspace builds it)
//! takes 72 bytes a value, vectors that grow by doubling, an allocation of
//! at least four values for any non-empty array and an index table plus an
//! entry vector for any object: a 4 MiB body of `[[[]]],` repeated held 421
//! MB once parsed, `{"":0},` 294 MB, `0,` 151 MB (227 MB at the peak), and
//! parsing it took 0.3–0.7 s (docs/lab/). The server scans the body
//! first (one pass, no allocation), reserves what the scan bounds from its
//! request memory, and only then parses — on the blocking pool.

/// Bytes a separator (`,` or `:`) stands for: one more value (72 bytes) in
/// a vector grown by doubling — up to twice the values' room, and the old
/// buffer beside the new one while it grows: 3 × 72 (an object entry, a
/// 104-byte bucket and its index, has two separators).
const PER_SEPARATOR: u64 = 216;
/// An array's first allocation: four values.
const PER_ARRAY: u64 = 288;
/// An object's index table and first entries.
const PER_OBJECT: u64 = 512;
/// A string's allocation and the allocator's overhead (its bytes are
/// counted with the body's).
const PER_STRING: u64 = 32;

/// An upper bound of the heap `serde_json::from_slice::<Value>` takes for
/// `body` (its bytes included), from one pass over the bytes counting
/// arrays, objects, separators and strings outside strings. Checked against
/// a counting allocator on the shapes that cost the most per byte (the
/// `json_cost` test); about 1.5–3× what ordinary requests take.
pub fn json_parse_bytes(body: &[u8]) -> u64 {
    let (mut arrays, mut objects, mut seps, mut strings) = (0u64, 0u64, 0u64, 0u64);
    let (mut in_string, mut escaped) = (false, false);
    // the last byte outside strings that is not whitespace: `{}` and `[]`
    // allocate nothing
    let mut prev = 0u8;
    for &c in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
            }
            continue;
        }
        match c {
            b'"' => {
                in_string = true;
                strings += 1;
            }
            b'[' => arrays += 1,
            b'{' => objects += 1,
            b']' if prev == b'[' => arrays -= 1,
            b'}' if prev == b'{' => objects -= 1,
            b',' | b':' => seps += 1,
            _ => {}
        }
        if !c.is_ascii_whitespace() {
            prev = c;
        }
    }
    [body.len() as u64, arrays * PER_ARRAY, objects * PER_OBJECT, (seps + 1) * PER_SEPARATOR, strings * PER_STRING]
        .into_iter()
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structure_outside_strings_is_what_costs() {
        let plain = json_parse_bytes(br#""a,b:[c]{d}""#);
        // the same bytes' worth of structure inside the string costs nothing more
        assert_eq!(plain, 12 + PER_SEPARATOR + PER_STRING);
        let escaped = json_parse_bytes(br#""a\",[1]""#);
        assert_eq!(escaped, 9 + PER_SEPARATOR + PER_STRING, "an escaped quote does not end the string");
        let unescaped = json_parse_bytes(br#""a",[1]"#);
        assert_eq!(unescaped, 7 + 2 * PER_SEPARATOR + PER_STRING + PER_ARRAY);
        let nested = json_parse_bytes(b"[[[]]],[[[ ]]]");
        assert_eq!(nested, 14 + 4 * PER_ARRAY + 2 * PER_SEPARATOR, "an empty array allocates nothing");
        assert_eq!(json_parse_bytes(b"{ }"), 3 + PER_SEPARATOR, "nor does an empty object");
        assert_eq!(json_parse_bytes(b"{\"a\":1}"), 7 + PER_OBJECT + 2 * PER_SEPARATOR + PER_STRING);
    }
}
