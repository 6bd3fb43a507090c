//! Ranks, pre-tokenization and merging.

use crate::{Error, Result};
use base64::Engine;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

/// The pre-tokenizer pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Kimi's: o200k's with a leading `[\p{Han}]+` rule and Han removed from the letter classes.
    Kimi,
    /// OpenAI o200k_base.
    O200k,
    /// OpenAI cl100k_base.
    Cl100k,
}

const O200K_RULES: [&str; 7] = [
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
];

impl Pattern {
    /// Parse `kimi | o200k | cl100k`.
    pub fn parse(s: &str) -> Option<Pattern> {
        match s {
            "kimi" => Some(Pattern::Kimi),
            "o200k" => Some(Pattern::O200k),
            "cl100k" => Some(Pattern::Cl100k),
            _ => None,
        }
    }
    /// The regex source (the same string tiktoken is given).
    pub fn source(self) -> String {
        match self {
            Pattern::O200k => O200K_RULES.join("|"),
            Pattern::Cl100k => r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s".to_string(),
            Pattern::Kimi => {
                let no_han = |r: &str| {
                    r.replace(r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]")
                        .replace(r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]")
                };
                let mut rules = vec![r"[\p{Han}]+".to_string()];
                rules.extend(O200K_RULES.iter().map(|r| no_han(r)));
                rules.join("|")
            }
        }
    }
}

/// Resident bytes allowed for the compiled pre-tokenizer regex and its
/// matching caches: about 1.1 MB to compile the o200k and Kimi patterns,
/// the lazy DFAs' caches (2 MiB each at most), and the backtracking stack
/// of a text up to [`PRIVATE_REGEX_ABOVE`] (≤ 1.6 MB) — once, since only
/// the tokenizer's own thread matches with it.
pub const REGEX_ALLOWANCE: u64 = 8 << 20;

/// Texts longer than this are split by a regex compiled for that call
/// (about 9 ms) and dropped after it: fancy-regex keeps the backtracking
/// stack it grew (24 bytes a byte of the longest whitespace run, up to
/// 2^20 entries ≈ 25 MB) in the regex for good.
pub const PRIVATE_REGEX_ABOVE: usize = 16 << 10;

/// A text's own regex: compiling the o200k or Kimi pattern peaks at about
/// 1.1 MB, its caches take 0.3 MB (measured by the `working_memory` test's
/// allocator), with margin.
const PRIVATE_REGEX_BYTES: u64 = 2 << 20;

/// The backtracking VM's stack for a text of `n` bytes: about one entry
/// (24 bytes) a byte of the longest whitespace run (measured: 1 000 KiB of
/// spaces overflow fancy-regex's cap of 1,000,000 entries, 960 KiB do
/// not), counted as two a byte, in a doubling vector of at most 2^20.
fn vm_stack_bytes(n: usize) -> u64 {
    let entries = n.saturating_mul(2).saturating_add(64).checked_next_power_of_two().unwrap_or(usize::MAX);
    entries.min(1 << 20) as u64 * 24
}

/// A tiktoken-style tokenizer.
pub struct Tokenizer {
    ranks: HashMap<Vec<u8>, u32>,
    decoder: HashMap<u32, Vec<u8>>,
    specials: Vec<(u32, String)>,
    special_ids: HashMap<String, u32>,
    regex: fancy_regex::Regex,
    pattern: Pattern,
    /// The longest token's bytes (a rank's or a special's text).
    max_token_bytes: usize,
    /// The encoding thread (started by the first encoding) and the process
    /// it runs in (a forked child has no such thread), held while encoding:
    /// see [`Tokenizer::on_encoder`].
    encoder: std::sync::Mutex<Option<(u32, std::sync::mpsc::Sender<Job>)>>,
}

/// One encoding for the encoding thread: the tokenizer and the text are
/// borrowed from the caller, who waits for `reply` (or its drop) before
/// the borrows end.
struct Job {
    tok: *const Tokenizer,
    text: *const str,
    markup: bool,
    reply: std::sync::mpsc::SyncSender<Vec<u32>>,
}

// SAFETY: the pointers are only dereferenced by the encoding thread while
// the caller that made them blocks in `on_encoder` with both borrows alive
// (until `reply` is sent or dropped, which the thread does only after its
// last use of them); `Tokenizer` is `Sync` and `str` is `Sync`.
unsafe impl Send for Job {}

// what the SAFETY above relies on: a `&Tokenizer` may be used from the encoding thread
const _: fn() = || {
    fn sync<T: Sync>() {}
    sync::<Tokenizer>();
};

/// Start an encoding thread; `None` if the OS refuses one.
fn spawn_encoder() -> Option<std::sync::mpsc::Sender<Job>> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let run = move || {
        // ends when the tokenizer (the sender) is dropped
        while let Ok(job) = rx.recv() {
            // SAFETY: see `Job`: the caller waits with both borrows alive.
            let (tok, text) = unsafe { (&*job.tok, &*job.text) };
            let ids = tok.encode_here(text, job.markup);
            let _ = job.reply.send(ids);
        }
    };
    std::thread::Builder::new().name("waste-tokenize".into()).spawn(run).ok().map(|_| tx)
}

/// Bytes one heap allocation of `n` bytes occupies (glibc-style: a 16-byte
/// granule and an 8-byte header, 32 at least); 0 for no allocation.
fn alloc_bytes(n: usize) -> u64 {
    if n == 0 {
        0
    } else {
        (n.saturating_add(8).div_ceil(16) as u64 * 16).max(32)
    }
}

/// Bytes of a hash table's slots (entries plus one control byte each).
fn table_bytes<K, V>(m: &HashMap<K, V>) -> u64 {
    alloc_bytes(m.capacity() * (std::mem::size_of::<(K, V)>() + 1))
}

impl Tokenizer {
    /// Resident bytes of the tokenizer's tables (rank and decoder maps with
    /// their keys, specials), counted from their capacities with the
    /// allocator's per-allocation overhead, plus [`REGEX_ALLOWANCE`] for the
    /// compiled pre-tokenizer. The memory plan counts this.
    pub fn heap_bytes(&self) -> u64 {
        let ranks = table_bytes(&self.ranks) + self.ranks.keys().map(|k| alloc_bytes(k.capacity())).sum::<u64>();
        let dec = table_bytes(&self.decoder) + self.decoder.values().map(|v| alloc_bytes(v.capacity())).sum::<u64>();
        let specials = alloc_bytes(self.specials.capacity() * std::mem::size_of::<(u32, String)>())
            + self.specials.iter().map(|(_, s)| alloc_bytes(s.capacity())).sum::<u64>();
        let ids =
            table_bytes(&self.special_ids) + self.special_ids.keys().map(|k| alloc_bytes(k.capacity())).sum::<u64>();
        ranks + dec + specials + ids + REGEX_ALLOWANCE
    }

    /// At most the heap bytes [`Tokenizer::encode_plain`] or
    /// [`Tokenizer::encode_markup`] hold at once for a text of `text_bytes`
    /// bytes, beyond the tables ([`Tokenizer::heap_bytes`]): the worst case
    /// is one piece as long as the text that merges down byte by byte — the
    /// merge's links, flags, versions and heap (reserved whole) — while the
    /// ids grow to one per byte (a doubling vector: its last two buffers at
    /// once), plus the markup scan's one position per special, plus, above
    /// [`PRIVATE_REGEX_ABOVE`], the text's own regex with its largest
    /// backtracking stack. Encodings take turns, so this is the whole
    /// process's. The memory plan counts it for the longest text a context
    /// admits; the test `working_memory` checks it with a counting allocator.
    pub fn encode_working_bytes(&self, text_bytes: usize) -> u64 {
        let n = text_bytes;
        if n == 0 {
            return 0;
        }
        fn merge<L>(n: usize) -> u64 {
            let links = alloc_bytes((n + 1).saturating_mul(std::mem::size_of::<L>()));
            let heap = alloc_bytes(n.saturating_mul(2).saturating_mul(std::mem::size_of::<Reverse<(u32, L, u32)>>()));
            [links, links, alloc_bytes(n + 1), alloc_bytes((n + 1).saturating_mul(4)), heap]
                .into_iter()
                .fold(0, u64::saturating_add)
        }
        let merge = if n < u32::MAX as usize - 1 { merge::<u32>(n) } else { merge::<u64>(n) };
        let cap = n.checked_next_power_of_two().unwrap_or(usize::MAX).max(4);
        let ids = alloc_bytes(cap.saturating_mul(4)) + alloc_bytes(cap / 2 * 4);
        let scan = alloc_bytes(self.specials.len() * std::mem::size_of::<Option<usize>>());
        if n <= PRIVATE_REGEX_ABOVE {
            return merge.saturating_add(ids).saturating_add(scan);
        }
        // the stack stays in the text's regex while the pieces merge; while
        // it grows, its old and new buffers are held at once
        let vm = vm_stack_bytes(n);
        let matching = (vm + vm / 2).max(vm.saturating_add(merge));
        [PRIVATE_REGEX_BYTES, matching, ids, scan].into_iter().fold(0, u64::saturating_add)
    }

    /// Build from ranks, specials and a pattern.
    ///
    /// # Errors
    /// [`Error::Pattern`] when the pattern does not compile;
    /// [`Error::Vocabulary`] when two tokens share an id (two ranks, two
    /// specials, or a special and a rank) or a special's text.
    pub fn new(ranks: Vec<(Vec<u8>, u32)>, specials: Vec<(u32, String)>, pattern: Pattern) -> Result<Tokenizer> {
        let regex = fancy_regex::Regex::new(&pattern.source()).map_err(|e| Error::Pattern(e.to_string()))?;
        let mut decoder = HashMap::with_capacity(ranks.len() + specials.len());
        for (b, r) in &ranks {
            if decoder.insert(*r, b.clone()).is_some() {
                return Err(Error::Vocabulary(format!("rank {r} is given to two tokens")));
            }
        }
        for (id, s) in &specials {
            if let Some(b) = decoder.insert(*id, s.as_bytes().to_vec()) {
                let what = String::from_utf8_lossy(&b);
                return Err(Error::Vocabulary(format!("special {s:?} has id {id}, which {what:?} already has")));
            }
        }
        let special_ids: HashMap<String, u32> = specials.iter().map(|(i, s)| (s.clone(), *i)).collect();
        if special_ids.len() != specials.len() {
            return Err(Error::Vocabulary("a special token's text is listed twice".into()));
        }
        let mut specials = specials;
        // longest first, so markup matching is leftmost-longest
        specials.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        let max_token_bytes = decoder.values().map(Vec::len).max().unwrap_or(0);
        Ok(Tokenizer {
            ranks: ranks.into_iter().collect(),
            decoder,
            specials,
            special_ids,
            regex,
            pattern,
            max_token_bytes,
            encoder: std::sync::Mutex::new(None),
        })
    }

    /// Parse a tiktoken rank file (`base64 rank` per line).
    ///
    /// # Errors
    /// [`Error::RankFile`] naming the line for malformed base64 or a bad rank.
    /// A rank given twice, or a token's bytes listed twice, is an error
    /// naming both lines (tiktoken refuses the first; either makes decoding
    /// ambiguous).
    pub fn parse_ranks(text: &str, file: &str) -> Result<Vec<(Vec<u8>, u32)>> {
        let mut out = Vec::new();
        // rank → line, bytes → line (1-based)
        let (mut by_rank, mut by_bytes) = (HashMap::new(), HashMap::new());
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let err = |msg: String| Error::RankFile { file: file.into(), line: i + 1, msg };
            let (tok, rank) = line.split_once(' ').ok_or_else(|| err("expected `base64 rank`".into()))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(tok.trim())
                .map_err(|e| err(format!("bad base64: {e}")))?;
            let rank: u32 = rank.trim().parse().map_err(|_| err(format!("bad rank {rank:?}")))?;
            if let Some(first) = by_rank.insert(rank, i + 1) {
                return Err(err(format!("rank {rank} was already given on line {first}")));
            }
            if let Some(first) = by_bytes.insert(bytes.clone(), i + 1) {
                return Err(err(format!("token {tok:?} was already listed on line {first}")));
            }
            out.push((bytes, rank));
        }
        Ok(out)
    }

    /// Parse `specials.json`: `[{"id": N, "text": "<|...|>"}, ...]`.
    ///
    /// # Errors
    /// [`Error::Json`] naming the file for malformed specials.
    pub fn parse_specials(text: &str, file: &str) -> Result<Vec<(u32, String)>> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::Json { file: file.into(), msg: e.to_string() })?;
        let arr = v.as_array().ok_or_else(|| Error::Json { file: file.into(), msg: "expected an array".into() })?;
        let json = |msg: String| Error::Json { file: file.into(), msg };
        let (mut ids, mut texts) = (HashMap::new(), HashMap::new());
        arr.iter()
            .map(|e| {
                let id = e.get("id").and_then(|x| x.as_u64()).filter(|&x| x < u32::MAX as u64);
                let text = e.get("text").and_then(|x| x.as_str()).filter(|s| !s.is_empty());
                let (Some(id), Some(t)) = (id, text) else {
                    return Err(json(format!("entry {e} needs an integer id and a non-empty text")));
                };
                if let Some(first) = ids.insert(id, t) {
                    return Err(json(format!("id {id} is given to both {first:?} and {t:?}")));
                }
                if let Some(first) = texts.insert(t, id) {
                    return Err(json(format!("{t:?} has two ids, {first} and {id}")));
                }
                Ok((id as u32, t.to_string()))
            })
            .collect()
    }

    /// Load a container's `tokenizer.model` + `specials.json` (Kimi's pattern).
    ///
    /// # Errors
    /// As [`Tokenizer::from_files`].
    pub fn from_container_dir(dir: &Path) -> Result<Tokenizer> {
        Self::from_files(&dir.join("tokenizer.model"), Some(&dir.join("specials.json")), Pattern::Kimi)
    }

    /// Load a rank file, optional specials, and a pattern.
    ///
    /// # Errors
    /// [`Error::Io`] for a missing, non-regular or oversized file, and the parse errors of its contents.
    pub fn from_files(ranks: &Path, specials: Option<&Path>, pattern: Pattern) -> Result<Tokenizer> {
        let read = |p: &Path| crate::read_text(p, crate::MAX_TOKENIZER_FILE_BYTES);
        let r = Self::parse_ranks(&read(ranks)?, &ranks.display().to_string())?;
        let s = match specials {
            Some(p) if p.exists() => Self::parse_specials(&read(p)?, &p.display().to_string())?,
            _ => vec![],
        };
        Self::new(r, s, pattern)
    }

    /// The pattern in use.
    pub fn pattern(&self) -> Pattern {
        self.pattern
    }
    /// Id of a special token's text.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.special_ids.get(text).copied()
    }
    /// Whether `id` is a special token.
    pub fn is_special(&self, id: u32) -> bool {
        self.specials.iter().any(|(i, _)| *i == id)
    }
    /// Number of ids (ranks + specials).
    pub fn vocab_len(&self) -> usize {
        self.decoder.len()
    }
    /// The most bytes one token stands for: text of more than `n` times
    /// this encodes to more than `n` tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }
    /// The largest id (rank or special), if any.
    pub fn max_id(&self) -> Option<u32> {
        self.decoder.keys().copied().max()
    }
    /// Whether `id` is a token of this vocabulary (a rank or a special).
    pub fn has_id(&self, id: u32) -> bool {
        self.decoder.contains_key(&id)
    }

    /// Encode text with special-token text kept as ordinary text.
    pub fn encode_plain(&self, text: &str) -> Vec<u32> {
        self.on_encoder(text, false)
    }

    /// Encode on the tokenizer's own thread, one text at a time. The regex
    /// engine keeps matching caches and backtracking stacks per thread that
    /// used it (in pools of up to nine): on one thread they exist once, and
    /// one text's working memory at a time is what the memory plan counts
    /// ([`Tokenizer::encode_working_bytes`]). Without a thread (the OS
    /// refused one, or it died), here.
    fn on_encoder(&self, text: &str, markup: bool) -> Vec<u32> {
        let mut encoder = self.encoder.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if encoder.as_ref().is_none_or(|(p, _)| *p != pid) {
            *encoder = spawn_encoder().map(|tx| (pid, tx));
        }
        if let Some((_, tx)) = encoder.as_ref() {
            let (reply, answer) = std::sync::mpsc::sync_channel(1);
            let job = Job { tok: self, text, markup, reply };
            if tx.send(job).is_ok() {
                // blocks until the thread replies or drops `reply`: the
                // borrows in `job` stay alive until then
                if let Ok(ids) = answer.recv() {
                    return ids;
                }
            }
            *encoder = None;
        }
        self.encode_here(text, markup)
    }

    /// Encode on the calling thread; a text longer than
    /// [`PRIVATE_REGEX_ABOVE`] with a regex of its own (see there; should
    /// the pattern fail to compile again — it compiled in `new` — the
    /// shared one).
    fn encode_here(&self, text: &str, markup: bool) -> Vec<u32> {
        let private = (text.len() > PRIVATE_REGEX_ABOVE).then(|| fancy_regex::Regex::new(&self.pattern.source()).ok());
        let re = private.flatten();
        let re = re.as_ref().unwrap_or(&self.regex);
        if markup {
            self.markup_with(re, text)
        } else {
            let mut out = Vec::new();
            self.encode_ordinary_into(re, text, &mut out);
            out
        }
    }

    /// Encode text with special tokens recognised: the leftmost special,
    /// the longest among those starting there. Each special's next
    /// occurrence is searched again only once the scan has passed it, so a
    /// text with many specials costs one pass per special, not one per
    /// special per match.
    pub fn encode_markup(&self, text: &str) -> Vec<u32> {
        self.on_encoder(text, true)
    }

    /// [`Tokenizer::encode_markup`]'s scan, splitting with `re`.
    fn markup_with(&self, re: &fancy_regex::Regex, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = 0;
        // per special (in `specials` order): its first occurrence at or
        // after `at` once refreshed below; None when there is none (`at`
        // only grows, so none ever again)
        let mut next: Vec<Option<usize>> = self.specials.iter().map(|(_, s)| text.find(s.as_str())).collect();
        while at < text.len() {
            let mut best: Option<(usize, usize, u32)> = None;
            for (k, (id, s)) in self.specials.iter().enumerate() {
                if next[k].is_some_and(|p| p < at) {
                    next[k] = text[at..].find(s.as_str()).map(|p| at + p);
                }
                if let Some(p) = next[k] {
                    if best.is_none_or(|(bp, bl, _)| p < bp || (p == bp && s.len() > bl)) {
                        best = Some((p, s.len(), *id));
                    }
                }
            }
            match best {
                Some((p, l, id)) => {
                    self.encode_ordinary_into(re, &text[at..p], &mut out);
                    out.push(id);
                    at = p + l;
                }
                None => {
                    self.encode_ordinary_into(re, &text[at..], &mut out);
                    break;
                }
            }
        }
        out
    }

    /// Exactly tiktoken's loop: every regex match is one piece. Returns the
    /// offset where the regex engine gave up, if it did.
    fn encode_matches(&self, re: &fancy_regex::Regex, text: &str, out: &mut Vec<u32>) -> Option<usize> {
        let mut last = 0;
        for m in re.find_iter(text) {
            match m {
                Ok(m) => {
                    self.bpe(m.as_str().as_bytes(), out);
                    last = m.end();
                }
                Err(_) => return Some(last),
            }
        }
        None
    }

    fn encode_ordinary_into(&self, re: &fancy_regex::Regex, text: &str, out: &mut Vec<u32>) {
        // The backtracking VM's stack is bounded (tiktoken itself panics here,
        // e.g. on a megabyte of spaces): continue on bounded windows, and
        // inside a window that still fails, one piece per character.
        const WINDOW: usize = 1 << 16;
        let Some(at) = self.encode_matches(re, text, out) else { return };
        let mut rest = &text[at..];
        while !rest.is_empty() {
            let mut cut = rest.len().min(WINDOW);
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            let (w, r) = rest.split_at(cut);
            if let Some(fail) = self.encode_matches(re, w, out) {
                let mut buf = [0u8; 4];
                for ch in w[fail..].chars() {
                    self.bpe(ch.encode_utf8(&mut buf).as_bytes(), out);
                }
            }
            rest = r;
        }
    }

    fn rank(&self, b: &[u8]) -> u32 {
        self.ranks.get(b).copied().unwrap_or(u32::MAX)
    }

    /// tiktoken's merge: repeatedly merge the adjacent pair whose
    /// concatenation has the lowest rank (leftmost on ties), in O(n log n).
    fn bpe(&self, piece: &[u8], out: &mut Vec<u32>) {
        if piece.is_empty() {
            return;
        }
        if let Some(&r) = self.ranks.get(piece) {
            out.push(r);
            return;
        }
        match piece.len() {
            // 4-byte links for any real piece; 8-byte ones past 4 GiB
            n if n < u32::MAX as usize - 1 => self.merge::<u32>(piece, out),
            _ => self.merge::<u64>(piece, out),
        }
    }

    /// [`Tokenizer::bpe`]'s merge loop with the part links stored as `L`
    /// (the working memory is about 2·|L| + 5 bytes a byte of piece, plus
    /// the heap's entries).
    fn merge<L: Link>(&self, piece: &[u8], out: &mut Vec<u32>) {
        let n = piece.len();
        // parts as a linked list of byte offsets: part i spans [i, next[i])
        let mut next: Vec<L> = (1..=n + 1).map(L::new).collect();
        let mut prev: Vec<L> = (0..=n).map(|i| L::new(i.wrapping_sub(1))).collect();
        let mut alive = vec![true; n + 1];
        let mut ver = vec![0u32; n + 1];
        let pair_rank = |i: usize, next: &[L]| -> u32 {
            let j = next[i].get();
            if j >= n {
                return u32::MAX;
            }
            self.rank(&piece[i..next[j].get()])
        };
        // at most n − 1 first entries plus one per merge (each merge pops
        // one and pushes two; merges ≤ n − 1): reserved whole, so the heap
        // never reallocates (old and new buffers at once) and
        // `encode_working_bytes` holds
        let mut heap: BinaryHeap<Reverse<(u32, L, u32)>> = BinaryHeap::with_capacity(2 * n);
        for i in 0..n - 1 {
            let r = pair_rank(i, &next);
            if r != u32::MAX {
                heap.push(Reverse((r, L::new(i), 0)));
            }
        }
        while let Some(Reverse((_, i, v))) = heap.pop() {
            let i = i.get();
            if !alive[i] || ver[i] != v || next[i].get() >= n {
                continue;
            }
            // merge part i with its successor j
            let j = next[i].get();
            alive[j] = false;
            next[i] = next[j];
            if next[j].get() <= n {
                prev[next[j].get()] = L::new(i);
            }
            ver[i] += 1;
            let ri = pair_rank(i, &next);
            if ri != u32::MAX {
                heap.push(Reverse((ri, L::new(i), ver[i])));
            }
            let p = prev[i].get();
            if p < n && alive[p] {
                ver[p] += 1;
                let rp = pair_rank(p, &next);
                if rp != u32::MAX {
                    heap.push(Reverse((rp, L::new(p), ver[p])));
                }
            }
        }
        let mut i = 0;
        while i < n {
            let j = next[i].get();
            let b = &piece[i..j.min(n)];
            match self.ranks.get(b) {
                Some(&r) => out.push(r),
                // a byte with no rank (a partial vocabulary): emit each byte's rank if any
                None => out.extend(b.iter().filter_map(|x| self.ranks.get(std::slice::from_ref(x)).copied())),
            }
            i = j;
        }
    }

    /// Bytes of one id (empty for an unknown id).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.decoder.get(&id).map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// Decode ids to text (invalid UTF-8 replaced by U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut b = Vec::new();
        for &i in ids {
            b.extend_from_slice(self.token_bytes(i));
        }
        String::from_utf8_lossy(&b).into_owned()
    }
}

/// A part link of [`Tokenizer::merge`]: a byte offset stored in 4 bytes
/// (every real piece) or 8. `new` keeps the low bits, so the "no previous
/// part" link (`usize::MAX`) reads back as an offset past any piece.
trait Link: Copy + Ord {
    fn new(i: usize) -> Self;
    fn get(self) -> usize;
}

impl Link for u32 {
    fn new(i: usize) -> Self {
        i as u32
    }
    fn get(self) -> usize {
        if self == u32::MAX {
            usize::MAX
        } else {
            self as usize
        }
    }
}

impl Link for u64 {
    fn new(i: usize) -> Self {
        i as u64
    }
    fn get(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank file of the 256 single bytes (`base64 rank` lines) and `extra` lines.
    fn ranks_text(extra: &[&str]) -> String {
        use base64::Engine;
        let mut t: Vec<String> =
            (0..=255u8).map(|b| format!("{} {b}", base64::engine::general_purpose::STANDARD.encode([b]))).collect();
        t.extend(extra.iter().map(|s| s.to_string()));
        t.join("\n")
    }

    /// The markup scan as first written: every special searched in the
    /// whole rest after every match (quadratic in the matches).
    fn markup_naive(t: &Tokenizer, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut best: Option<(usize, usize, u32)> = None;
            for (id, s) in &t.specials {
                if let Some(p) = rest.find(s.as_str()) {
                    if best.is_none_or(|(bp, bl, _)| p < bp || (p == bp && s.len() > bl)) {
                        best = Some((p, s.len(), *id));
                    }
                }
            }
            let Some((p, l, id)) = best else {
                t.encode_ordinary_into(&t.regex, rest, &mut out);
                break;
            };
            t.encode_ordinary_into(&t.regex, &rest[..p], &mut out);
            out.push(id);
            rest = &rest[p + l..];
        }
        out
    }

    /// Overlapping, nested and prefix-sharing specials.
    fn markup_tokenizer() -> Tokenizer {
        let ranks = Tokenizer::parse_ranks(&ranks_text(&[]), "r").unwrap();
        let sp = ["<|a|>", "<|a|>b", "|a", "a|><", "<|", "><|a", "<|never|>"];
        Tokenizer::new(
            ranks,
            sp.iter().enumerate().map(|(i, s)| (300 + i as u32, s.to_string())).collect(),
            Pattern::Kimi,
        )
        .unwrap()
    }

    /// tiktoken's merge as its simple form states it: while some adjacent
    /// pair of parts has a rank, merge the lowest-ranked (leftmost on
    /// ties); quadratic, so only for short pieces.
    fn merge_naive(t: &Tokenizer, piece: &[u8]) -> Vec<u32> {
        let mut parts: Vec<&[u8]> = piece.chunks(1).collect();
        loop {
            let best = (0..parts.len().saturating_sub(1))
                .filter_map(|i| {
                    let joined = [parts[i], parts[i + 1]].concat();
                    t.ranks.get(&joined).map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let joined =
                &piece[parts[..i].iter().map(|p| p.len()).sum::<usize>()..][..parts[i].len() + parts[i + 1].len()];
            parts.splice(i..i + 2, [joined]);
        }
        parts.iter().map(|p| t.ranks[*p]).collect()
    }

    /// Merges that overlap and chain (`aa`, `aaa`, `ab`, `aab`, `ba`, …),
    /// so the order of merges decides the result.
    fn merge_tokenizer() -> Tokenizer {
        let merges =
            ["YWE= 256", "YWFh 257", "YWI= 258", "YWFi 259", "YmE= 260", "YmFh 261", "YWFhYQ== 262", "Y2E= 263"];
        let ranks = Tokenizer::parse_ranks(&ranks_text(&merges), "r").unwrap();
        Tokenizer::new(ranks, vec![], Pattern::Kimi).unwrap()
    }

    proptest::proptest! {
        #[test]
        fn merge_with_either_link_width_equals_the_naive_merge(b in proptest::collection::vec(0u8..3, 1..60)) {
            let t = merge_tokenizer();
            let piece: Vec<u8> = b.iter().map(|&c| b"abc"[c as usize]).collect();
            let want = merge_naive(&t, &piece);
            let (mut narrow, mut wide) = (Vec::new(), Vec::new());
            t.merge::<u32>(&piece, &mut narrow);
            t.merge::<u64>(&piece, &mut wide);
            proptest::prop_assert_eq!(&narrow, &want);
            proptest::prop_assert_eq!(&wide, &want);
        }
    }

    proptest::proptest! {
        #[test]
        fn markup_scan_equals_the_naive_scan(parts in proptest::collection::vec(0usize..9, 0..40)) {
            let t = markup_tokenizer();
            let pieces = ["<|a|>", "<|a|>b", "|a", "a|><", "<|", "><|a", "x", "é", "b"];
            let text: String = parts.iter().map(|&i| pieces[i]).collect();
            proptest::prop_assert_eq!(t.encode_markup(&text), markup_naive(&t, &text));
        }
    }

    /// 200 000 specials in 1 MB of markup: one pass per special. The first
    /// scan searched an absent special's whole rest after every match:
    /// quadratic (release build: 3.7 s for the first 200 KB of this text
    /// with the one absent special here, ≈ 90 s for all of it, and K3 has
    /// hundreds of specials; this scan 48 ms). Not a timed assertion: the
    /// quadratic scan would not finish in the suite's time.
    #[test]
    fn many_specials_in_long_markup_are_one_pass() {
        let t = markup_tokenizer();
        let text = "<|a|>".repeat(200_000);
        assert_eq!(t.encode_markup(&text), vec![300; 200_000]);
    }

    #[test]
    fn a_repeated_rank_or_token_names_both_lines() {
        // "YWI=" is "ab"; line 257 repeats rank 3 (line 4), then "ab" twice
        let e = Tokenizer::parse_ranks(&ranks_text(&["YWI= 3"]), "r").unwrap_err().to_string();
        assert_eq!(e, "r: line 257: rank 3 was already given on line 4");
        let e = Tokenizer::parse_ranks(&ranks_text(&["YWI= 256", "YWI= 257"]), "r").unwrap_err().to_string();
        assert_eq!(e, "r: line 258: token \"YWI=\" was already listed on line 257");
        assert_eq!(Tokenizer::parse_ranks(&ranks_text(&["YWI= 256"]), "r").unwrap().len(), 257);
    }

    #[test]
    fn specials_sharing_an_id_or_a_text_are_refused() {
        let e = Tokenizer::parse_specials(r#"[{"id": 300, "text": "<|a|>"}, {"id": 300, "text": "<|b|>"}]"#, "s")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "s: id 300 is given to both \"<|a|>\" and \"<|b|>\"");
        let e = Tokenizer::parse_specials(r#"[{"id": 300, "text": "<|a|>"}, {"id": 301, "text": "<|a|>"}]"#, "s")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "s: \"<|a|>\" has two ids, 300 and 301");
    }

    #[test]
    fn a_special_on_a_rank_id_is_refused_and_max_id_counts_both() {
        let ranks = Tokenizer::parse_ranks(&ranks_text(&[]), "r").unwrap();
        let e = Tokenizer::new(ranks.clone(), vec![(65, "<|a|>".into())], Pattern::Kimi).err().unwrap().to_string();
        assert_eq!(e, "tokenizer: special \"<|a|>\" has id 65, which \"A\" already has");
        let e = Tokenizer::new(ranks.clone(), vec![(300, "<|a|>".into()), (301, "<|a|>".into())], Pattern::Kimi)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("listed twice"), "{e}");
        let t = Tokenizer::new(ranks, vec![(300, "<|a|>".into())], Pattern::Kimi).unwrap();
        assert_eq!(t.max_id(), Some(300));
    }
}
