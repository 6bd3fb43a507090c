//! RAM budget: usable memory (physical RAM and cgroup v1/v2 limits) and the
//! default-budget rule.

use std::path::{Path, PathBuf};

/// Physical RAM in bytes (0 if unknown): `hw.memsize` on macOS, else
/// `sysconf` pages × page size.
pub fn physical_ram() -> u64 {
    #[cfg(target_os = "macos")]
    if let Some(v) = sysctl_u64("hw.memsize") {
        return v;
    }
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages > 0 && size > 0 {
            return pages as u64 * size as u64;
        }
    }
    0
}

/// Where the cgroup information lives (parameters so tests can use synthetic trees).
#[derive(Clone, Debug)]
pub struct CgroupPaths {
    /// `/proc/self/cgroup`.
    pub proc_self_cgroup: PathBuf,
    /// The cgroup v2 mount (`/sys/fs/cgroup`).
    pub v2_root: PathBuf,
    /// The cgroup v1 memory controller mount (`/sys/fs/cgroup/memory`).
    pub v1_memory_root: PathBuf,
}

impl Default for CgroupPaths {
    fn default() -> Self {
        CgroupPaths {
            proc_self_cgroup: "/proc/self/cgroup".into(),
            v2_root: "/sys/fs/cgroup".into(),
            v1_memory_root: "/sys/fs/cgroup/memory".into(),
        }
    }
}

fn read_limit(p: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(p).ok()?;
    let s = s.trim();
    if s == "max" {
        return None;
    }
    let v: u64 = s.parse().ok()?;
    // v1 reports "unlimited" as a huge page-rounded number
    (v < (1u64 << 62)).then_some(v)
}

fn walk_up(root: &Path, rel: &str, files: &[&str]) -> Option<u64> {
    let rel = rel.trim_start_matches('/');
    let mut dir = root.join(rel);
    let mut best: Option<u64> = None;
    loop {
        if !dir.starts_with(root) {
            break;
        }
        for f in files {
            if let Some(v) = read_limit(&dir.join(f)) {
                best = Some(best.map_or(v, |b| b.min(v)));
            }
        }
        if dir == root || !dir.pop() {
            break;
        }
    }
    best
}

/// The smallest memory limit of this process's cgroup and its ancestors,
/// cgroup v2 (`memory.max`, `memory.high`) and v1 (`memory.limit_in_bytes`).
pub fn cgroup_limit(p: &CgroupPaths) -> Option<u64> {
    let text = std::fs::read_to_string(&p.proc_self_cgroup).ok()?;
    let mut best: Option<u64> = None;
    let mut take = |v: Option<u64>| {
        if let Some(v) = v {
            best = Some(best.map_or(v, |b: u64| b.min(v)));
        }
    };
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        if id == "0" && ctrls.is_empty() {
            take(walk_up(&p.v2_root, path, &["memory.max", "memory.high"]));
        } else if ctrls.split(',').any(|c| c == "memory") {
            take(walk_up(&p.v1_memory_root, path, &["memory.limit_in_bytes"]));
        }
    }
    best
}

/// Usable RAM: physical RAM, or a smaller cgroup limit.
pub fn usable_ram_with(p: &CgroupPaths) -> u64 {
    let phys = physical_ram();
    match cgroup_limit(p) {
        Some(l) if phys == 0 || l < phys => l,
        _ => phys,
    }
}

/// Usable RAM of this process: physical RAM or a smaller cgroup limit on
/// Linux; on macOS (no cgroups) physical RAM, or what the system reports as
/// available while it is under memory pressure ([`usable_ram_macos`]).
pub fn usable_ram() -> u64 {
    #[cfg(target_os = "macos")]
    return usable_ram_macos(&MacMemory::probe());
    #[cfg(not(target_os = "macos"))]
    usable_ram_with(&CgroupPaths::default())
}

/// What macOS reports about memory (the inputs of [`usable_ram_macos`],
/// separate so the rule is tested with synthetic values on every OS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MacMemory {
    /// `hw.memsize`: physical RAM in bytes.
    pub memsize: u64,
    /// `kern.memorystatus_vm_pressure_level`: 1 normal, 2 warning, 4 critical.
    pub pressure_level: Option<u32>,
    /// `kern.memorystatus_level`: the share of memory available now, percent.
    pub available_percent: Option<u32>,
}

impl MacMemory {
    /// Read the three sysctls (absent ones are `None`; `memsize` 0 if unknown).
    #[cfg(target_os = "macos")]
    pub fn probe() -> MacMemory {
        MacMemory {
            memsize: physical_ram(),
            pressure_level: sysctl_u64("kern.memorystatus_vm_pressure_level").and_then(|v| u32::try_from(v).ok()),
            available_percent: sysctl_u64("kern.memorystatus_level").and_then(|v| u32::try_from(v).ok()),
        }
    }
}

/// The macOS rule: with no memory pressure (level 1, or unknown) the whole
/// physical RAM, as on Linux without a cgroup limit; under warning or
/// critical pressure (level ≥ 2) only the share the system reports as
/// available, so a default budget does not push the machine into swap and
/// the kernel's memory-status killer. macOS has no per-process limit like a
/// cgroup, so pressure is the only signal a budget can honour.
pub fn usable_ram_macos(m: &MacMemory) -> u64 {
    match (m.pressure_level, m.available_percent) {
        (Some(level), Some(pct)) if level >= 2 => (u128::from(m.memsize) * u128::from(pct.min(100)) / 100) as u64,
        _ => m.memsize,
    }
}

/// An integer sysctl by name (4- or 8-byte values), `None` when absent.
#[cfg(target_os = "macos")]
fn sysctl_u64(name: &str) -> Option<u64> {
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 8];
    let mut len: libc::size_t = buf.len();
    // SAFETY: buf is 8 writable bytes and len says so; no new value is set.
    let rc = unsafe { libc::sysctlbyname(cname.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) };
    match (rc, len) {
        (0, 8) => Some(u64::from_ne_bytes(buf)),
        (0, 4) => Some(u64::from(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]))),
        _ => None,
    }
}

/// The figures the budget rule needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Floor {
    /// Everything but the expert cache (trunk + state + scratch).
    pub fixed: u64,
    /// Smallest expert cache that works.
    pub min_cache: u64,
    /// One token's experts over all MoE layers.
    pub working_set: u64,
}

impl Floor {
    /// The smallest budget.
    pub fn floor(&self) -> u64 {
        self.fixed + self.min_cache
    }
    /// floor + 3 × working set.
    pub fn recommended(&self) -> u64 {
        self.floor() + 3 * self.working_set
    }
}

/// A resolved budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Total bytes.
    pub budget: u64,
    /// Bytes for the expert cache.
    pub cache_bytes: u64,
    /// Set when the rule fell back to the floor, or an explicit budget
    /// exceeds usable RAM.
    pub warning: Option<String>,
}

/// Why a budget cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("budget {budget} bytes is below the floor of {floor} bytes")]
pub struct BelowFloor {
    /// Asked.
    pub budget: u64,
    /// Needed.
    pub floor: u64,
}

/// Resolve a budget: `requested = 0` picks the largest of floor + 3×, 2×,
/// 1× working set that fits under 7/8 of `usable`, else the floor (with a
/// warning); an explicit budget below the floor is refused.
///
/// # Errors
/// [`BelowFloor`] when an explicit budget is below the floor.
pub fn resolve(f: &Floor, requested: u64, usable: u64) -> Result<Budget, BelowFloor> {
    let floor = f.floor();
    let budget = if requested == 0 {
        let cap = usable / 8 * 7;
        match [3, 2, 1].iter().map(|k| floor + k * f.working_set).find(|&b| b <= cap) {
            Some(b) => b,
            None => {
                return Ok(Budget { budget: floor, cache_bytes: f.min_cache, warning: Some(format!("usable RAM {usable} bytes leaves no room beyond the floor of {floor} bytes; expect many expert reads")) });
            }
        }
    } else if requested < floor {
        return Err(BelowFloor { budget: requested, floor });
    } else {
        requested
    };
    // more than this machine can give: the cache never holds more than the
    // container, but a cache that grows past usable RAM would swap or be killed
    let warning = (requested > usable).then(|| {
        format!(
            "budget {requested} bytes exceeds usable RAM of {usable} bytes ({:.1} GiB): the expert cache may outgrow memory",
            usable as f64 / (1u64 << 30) as f64
        )
    });
    Ok(Budget { budget, cache_bytes: budget - f.fixed, warning })
}

/// Parse a size like `8G`, `1.5G`, `512M`, `4096` (binary units: K = 1024).
/// A plain number is whole bytes, read exactly; `None` for anything that is
/// not a size, a fraction of a byte, or more bytes than a `u64` holds
/// (`99999999999999999999` used to become `u64::MAX` unannounced).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = s[i..].to_ascii_uppercase();
            let m = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1u64,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return None,
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let num = num.trim();
    if mult == 1 {
        if let Ok(b) = num.parse::<u64>() {
            return Some(b);
        }
    }
    let v: f64 = num.parse().ok()?;
    // a fraction of a byte is a forgotten unit ("0.5" meant 0.5G, and
    // became 0 bytes: the automatic budget)
    if mult == 1 && v.fract() != 0.0 {
        return None;
    }
    let b = v * mult as f64;
    // 2^64 (u64::MAX + 1, exact as f64) and past it do not fit: refused,
    // not saturated
    (v.is_finite() && v >= 0.0 && b < 18_446_744_073_709_551_616.0).then_some(b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed when the test ends (passing or not).
    struct Tree(PathBuf);
    impl std::ops::Deref for Tree {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn tree(tag: &str) -> Tree {
        let d = std::env::temp_dir().join(format!("waste-cg-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Tree(d)
    }
    fn put(p: &Path, s: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    }

    #[test]
    fn cgroup_v2_takes_the_smallest_of_the_chain_and_high() {
        let d = tree("v2");
        put(&d.join("proc"), "0::/user.slice/app.scope\n");
        put(&d.join("cg/user.slice/app.scope/memory.max"), "max\n");
        put(&d.join("cg/user.slice/app.scope/memory.high"), "3000000000\n");
        put(&d.join("cg/user.slice/memory.max"), "2000000000\n");
        put(&d.join("cg/memory.max"), "max\n");
        let p = CgroupPaths { proc_self_cgroup: d.join("proc"), v2_root: d.join("cg"), v1_memory_root: d.join("none") };
        assert_eq!(cgroup_limit(&p), Some(2_000_000_000));
        assert!(usable_ram_with(&p) <= 2_000_000_000);
    }

    #[test]
    fn cgroup_v1_memory_controller_and_unlimited() {
        let d = tree("v1");
        put(&d.join("proc"), "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n0::/\n");
        put(&d.join("mem/docker/abc/memory.limit_in_bytes"), "1073741824\n");
        put(&d.join("mem/docker/memory.limit_in_bytes"), "9223372036854771712\n");
        put(&d.join("v2/memory.max"), "max\n");
        let p = CgroupPaths { proc_self_cgroup: d.join("proc"), v2_root: d.join("v2"), v1_memory_root: d.join("mem") };
        assert_eq!(cgroup_limit(&p), Some(1 << 30));
        put(&d.join("mem/docker/abc/memory.limit_in_bytes"), "9223372036854771712\n");
        assert_eq!(cgroup_limit(&p), None);
    }

    #[test]
    fn macos_rule_uses_physical_ram_unless_under_pressure() {
        const G: u64 = 1 << 30;
        let m = |level, pct| MacMemory { memsize: 64 * G, pressure_level: level, available_percent: pct };
        // normal pressure, or the sysctls missing: the whole machine
        assert_eq!(usable_ram_macos(&m(Some(1), Some(12))), 64 * G);
        assert_eq!(usable_ram_macos(&m(None, None)), 64 * G);
        assert_eq!(usable_ram_macos(&m(Some(4), None)), 64 * G);
        // warning / critical: what is available now
        assert_eq!(usable_ram_macos(&m(Some(2), Some(25))), 16 * G);
        assert_eq!(usable_ram_macos(&m(Some(4), Some(5))), 64 * G * 5 / 100);
        // a nonsense percentage never grows the machine
        assert_eq!(usable_ram_macos(&m(Some(2), Some(250))), 64 * G);
        // and the budget rule then sizes within it
        let f = Floor { fixed: 2 * G, min_cache: G, working_set: 2 * G };
        assert_eq!(resolve(&f, 0, usable_ram_macos(&m(Some(1), None))).unwrap().budget, 9 * G);
        assert_eq!(resolve(&f, 0, usable_ram_macos(&m(Some(2), Some(10)))).unwrap().budget, 5 * G);
    }

    #[test]
    fn budget_rule() {
        let f = Floor { fixed: 1000, min_cache: 100, working_set: 500 };
        assert_eq!(f.floor(), 1100);
        // 7/8 of 4000 = 3500 → floor + 3ws = 2600 fits
        assert_eq!(resolve(&f, 0, 4000).unwrap().budget, 2600);
        // 7/8 of 2400 = 2100 → floor + 2ws = 2100 fits exactly; 7/8 of 2000 = 1750 → floor + 1ws
        assert_eq!(resolve(&f, 0, 2400).unwrap().budget, 2100);
        assert_eq!(resolve(&f, 0, 2000).unwrap().budget, 1600);
        let b = resolve(&f, 0, 1000).unwrap();
        assert_eq!(b.budget, 1100);
        assert!(b.warning.is_some());
        assert_eq!(resolve(&f, 1099, 1 << 40), Err(BelowFloor { budget: 1099, floor: 1100 }));
        assert_eq!(resolve(&f, 5000, 0).unwrap().cache_bytes, 4000);
        assert_eq!(parse_size("1.5G"), Some(1_610_612_736));
        assert_eq!(parse_size("512M"), Some(512 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("-1G"), None);
        assert_eq!(parse_size("0.5"), None, "a fraction of a byte: a forgotten unit");
        assert_eq!(parse_size("0.5K"), Some(512));
        // whole bytes exactly, to the last one a u64 holds; past it refused
        assert_eq!(parse_size("18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_size("9007199254740993"), Some((1 << 53) + 1), "above 2^53: not rounded as a float");
        assert_eq!(parse_size("18446744073709551616"), None);
        assert_eq!(parse_size("99999999999999999999"), None);
        assert_eq!(parse_size("16777216T"), None, "2^64 bytes");
        assert_eq!(parse_size("16777215T"), Some(16_777_215 << 40));
        assert_eq!(parse_size("1e30"), None);
        assert_eq!(parse_size("inf"), None);
        assert_eq!(parse_size("2.0"), Some(2), "a whole number written with a point");
    }
}
