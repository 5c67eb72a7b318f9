//! The kernel checked without a GPU: its entry point and parameters against the glue, and its
//! results against `driver/digest.rs`, by running the PTX in a small interpreter of the
//! instructions it uses (threads run freely between `shfl.sync` and `bar.sync`, where they
//! meet as on the device). The GPU suite (`tms-smoke`) checks the real thing.

use super::*;
use crate::driver::digest::block_partial;

/// The entry's parameter names, in order.
fn params_of(ptx: &str) -> (String, Vec<String>) {
    let at = ptx.find(".entry ").expect("an .entry") + ".entry ".len();
    let open = at + ptx[at..].find('(').expect("a parameter list");
    let close = open
        + ptx[open..]
            .find(')')
            .expect("the end of the parameter list");
    let name = ptx[at..open].trim().to_string();
    let params = ptx[open + 1..close]
        .split(',')
        .map(|p| {
            let words: Vec<&str> = p.split_whitespace().collect();
            assert_eq!(&words[..2], &[".param", ".u64"], "{p}");
            words[2].to_string()
        })
        .collect();
    (name, params)
}

#[test]
fn entry_and_parameters_match_the_launch() {
    let (name, params) = params_of(PTX);
    assert_eq!(name.as_bytes(), ENTRY.to_bytes());
    assert_eq!(params, PARAMS);
    assert!(PTX.is_ascii(), "ptxas refuses anything else");
    assert!(!PTX.contains('\0'));
}

#[test]
fn plans_cut_ranges_as_the_definition_does() {
    let p = Plan::new(0x1000, 10 * BLOCK_BYTES + 64, 4 * BLOCK_BYTES).unwrap();
    assert_eq!((p.pieces, p.per_piece, p.blocks), (3, 4, 4 + 4 + 3));
    let p = Plan::new(0x1000, 3 * (BLOCK_BYTES + 8), BLOCK_BYTES + 8).unwrap();
    assert_eq!((p.pieces, p.per_piece, p.blocks), (3, 2, 6));
    let p = Plan::new(0x1000, 24, 8).unwrap();
    assert_eq!((p.pieces, p.per_piece, p.blocks), (3, 1, 3));
    assert_eq!(Plan::new(0x1000, 0, 8).unwrap().blocks, 0);
    for (ptr, len, piece) in [
        (0x1000, 8, 0),
        (0x1000, 12, 8),
        (0x1000, 16, 12),
        (0x1004, 8, 8),
    ] {
        let e = Plan::new(ptr, len, piece).unwrap_err();
        assert_eq!(e.status(), crate::error::status::INVALID_ARGUMENT);
    }
    assert!(Plan::new(u64::MAX - 7, 16, 8).is_err());
}

/// The sums of every block of `len` bytes of `data` in pieces of `piece` bytes, computed by
/// the kernel in launches of at most `launch` blocks.
fn run_kernel(data: &[u8], piece: u64, seed: u64, launch: u64) -> Vec<u64> {
    let len = data.len() as u64;
    let plan = Plan::new(SRC, len, piece).unwrap();
    let prog = Program::parse(PTX);
    let mut sums = Vec::new();
    let mut first = 0;
    while first < plan.blocks {
        let n = launch.min(plan.blocks - first);
        let args = [SRC, len, piece, plan.per_piece, first, seed, OUT];
        let mut out = vec![0u8; n as usize * 16];
        for block in 0..n {
            prog.run_block(&args, block, data, &mut out);
        }
        sums.extend(
            out.chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap())),
        );
        first += n;
    }
    sums
}

#[test]
fn kernel_computes_the_definition() {
    let data = crate::test_data::pattern(3 * BLOCK_BYTES as usize, 0x2545_F491_4F6C_DD1D);
    let seed = 0x0123_4567_89AB_CDEF;
    let words = |n: u64| 8 * n;
    // Short blocks whose threads have 16 or 15 words (two rounds of eight; one, then seven
    // single words), 12 or 11, 8 or 7, 1 or none; the last piece shorter; launches cut.
    for (piece, len, launch) in [
        (
            BLOCK_BYTES + words(256 * 15 + 40),
            2 * BLOCK_BYTES + 1000,
            1,
        ),
        (words(256 * 11 + 40), 3 * words(256 * 11 + 40) + words(5), 3),
        (2 * BLOCK_BYTES, 2 * BLOCK_BYTES + words(256 * 7 + 1), 2),
    ] {
        let data = &data[..len as usize];
        let sums = run_kernel(data, piece, seed, launch);
        let blocks: Vec<&[u8]> = data
            .chunks(piece as usize)
            .flat_map(|p| p.chunks(BLOCK_BYTES as usize))
            .collect();
        assert_eq!(sums.len(), 2 * blocks.len());
        for (b, block) in blocks.iter().enumerate() {
            let want = block_partial(block, seed);
            assert_eq!(&sums[2 * b..2 * b + 2], &want, "piece {piece}, block {b}");
        }
        let plan = Plan::new(SRC, len, piece).unwrap();
        assert_eq!(plan.combine(&sums), digest::pieces(data, piece, seed));
    }
}

/// Runs the PTX through the `ptxas` that `TMS_PTXAS` names, where it does (CI has none).
#[test]
fn ptxas_assembles_the_kernel_when_given() {
    let Some(ptxas) = std::env::var_os("TMS_PTXAS") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("digest.ptx");
    std::fs::write(&file, PTX).unwrap();
    for arch in ["sm_90", "sm_80"] {
        let out = std::process::Command::new(&ptxas)
            .arg(format!("-arch={arch}"))
            .arg("-v")
            .arg(&file)
            .arg("-o")
            .arg(dir.path().join(format!("{arch}.cubin")))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        println!("{arch}:\n{text}");
        assert!(out.status.success(), "{arch}: {text}");
        assert!(
            text.contains(" 0 bytes spill stores"),
            "{arch} spills: {text}"
        );
    }
}

/// Where the interpreter puts the range and the launch's sums.
const SRC: u64 = 0x7f00_0000_0000;
const OUT: u64 = 0x7e00_0000_0000;

#[derive(Clone, Debug)]
enum Arg {
    Reg(usize),
    Imm(u64),
    Tid,
    Ctaid,
    /// A parameter or the shared array (at shared address 0).
    Sym(String),
    /// `[base+offset]`.
    Mem(Box<Arg>, u64),
    /// `{lo, hi}`.
    Pair(usize, usize),
}

#[derive(Debug)]
struct Inst {
    guard: Option<(usize, bool)>,
    op: String,
    args: Vec<Arg>,
}

struct Program {
    insts: Vec<Inst>,
    labels: std::collections::HashMap<String, usize>,
    regs: usize,
    params: Vec<String>,
}

/// Where a thread stopped.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stop {
    Sync(usize),
    Done,
}

impl Program {
    fn parse(ptx: &str) -> Program {
        let (_, params) = params_of(ptx);
        let body = &ptx[ptx.find('{').unwrap() + 1..ptx.rfind('}').unwrap()];
        let mut names = std::collections::HashMap::new();
        let mut reg = |name: &str| {
            let n = names.len();
            *names.entry(name.to_string()).or_insert(n)
        };
        let mut insts = Vec::new();
        let mut labels = std::collections::HashMap::new();
        for line in body.lines() {
            let line = line.split("//").next().unwrap().trim();
            if let Some(label) = line.strip_suffix(':') {
                labels.insert(label.to_string(), insts.len());
                continue;
            }
            for stmt in line.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                if stmt.starts_with('.') {
                    continue;
                }
                let (guard, stmt) = match stmt.strip_prefix('@') {
                    Some(rest) => {
                        let (p, rest) = rest.split_once(' ').unwrap();
                        let (neg, p) = match p.strip_prefix('!') {
                            Some(p) => (true, p),
                            None => (false, p),
                        };
                        (Some((reg(p), neg)), rest.trim())
                    }
                    None => (None, stmt),
                };
                let (op, rest) = stmt.split_once(char::is_whitespace).unwrap_or((stmt, ""));
                let args = split_args(rest)
                    .iter()
                    .map(|a| parse_arg(a, &mut reg))
                    .collect();
                insts.push(Inst {
                    guard,
                    op: op.to_string(),
                    args,
                });
            }
        }
        let regs = names.len();
        Program {
            insts,
            labels,
            regs,
            params,
        }
    }

    /// Run block `ctaid` of a launch with `args` over `data` (at [`SRC`]), writing `out` (at
    /// [`OUT`]).
    fn run_block(&self, args: &[u64], ctaid: u64, data: &[u8], out: &mut [u8]) {
        let threads = THREADS as usize;
        let mut regs = vec![vec![0u64; self.regs]; threads];
        let mut pcs = vec![0usize; threads];
        let mut shared = vec![0u8; 128];
        let mut mem = Mem {
            data,
            out,
            shared: &mut shared,
        };
        loop {
            let stops: Vec<Stop> = (0..threads)
                .map(|t| {
                    self.run_thread(&mut regs[t], &mut pcs[t], t as u64, ctaid, args, &mut mem)
                })
                .collect();
            if stops.iter().all(|s| *s == Stop::Done) {
                return;
            }
            let Stop::Sync(pc) = stops[0] else {
                panic!("thread 0 ended while others wait: {stops:?}")
            };
            assert!(
                stops.iter().all(|s| *s == Stop::Sync(pc)),
                "threads meet apart: {stops:?}"
            );
            let inst = &self.insts[pc];
            match inst.op.as_str() {
                "bar.sync" => {}
                "shfl.sync.down.b32" => {
                    let Arg::Reg(d) = inst.args[0] else {
                        panic!("{inst:?}")
                    };
                    for warp in regs.chunks_mut(32) {
                        let vals: Vec<u64> =
                            warp.iter().map(|r| val(&inst.args[1], r, 0, 0)).collect();
                        for (lane, r) in warp.iter_mut().enumerate() {
                            let src = lane + val(&inst.args[2], r, 0, 0) as usize;
                            assert_eq!(val(&inst.args[3], r, 0, 0), 31, "{inst:?}");
                            r[d] = if src <= 31 { vals[src] } else { vals[lane] };
                        }
                    }
                }
                _ => unreachable!(),
            }
            for pc in &mut pcs {
                *pc += 1;
            }
        }
    }

    /// Run one thread until it meets the others or returns.
    fn run_thread(
        &self,
        r: &mut [u64],
        pc: &mut usize,
        tid: u64,
        ctaid: u64,
        args: &[u64],
        mem: &mut Mem,
    ) -> Stop {
        loop {
            let inst = &self.insts[*pc];
            if let Some((p, neg)) = inst.guard {
                if (r[p] != 0) == neg {
                    *pc += 1;
                    continue;
                }
            }
            let a = &inst.args;
            let v = |i: usize, r: &[u64]| val(&a[i], r, tid, ctaid);
            // The destination's width (mul.wide's is twice its operands').
            let mask = if inst.op.ends_with("32") && !inst.op.starts_with("mul.wide") {
                0xFFFF_FFFF
            } else {
                u64::MAX
            };
            let result = match inst.op.as_str() {
                "ret" => return Stop::Done,
                "bar.sync" | "shfl.sync.down.b32" => return Stop::Sync(*pc),
                "bra" => {
                    let Arg::Sym(l) = &a[0] else {
                        panic!("{inst:?}")
                    };
                    *pc = self.labels[l];
                    continue;
                }
                "ld.param.u64" => {
                    let Arg::Mem(base, 0) = &a[1] else {
                        panic!("{inst:?}")
                    };
                    let Arg::Sym(name) = &**base else {
                        panic!("{inst:?}")
                    };
                    Some(args[self.params.iter().position(|p| p == name).unwrap()])
                }
                "ld.global.nc.u64" => Some(mem.load(addr(&a[1], r), false)),
                "ld.shared.u64" => Some(mem.load(addr(&a[1], r), true)),
                "st.global.u64" => {
                    mem.store(addr(&a[0], r), v(1, r), false);
                    None
                }
                "st.shared.u64" => {
                    mem.store(addr(&a[0], r), v(1, r), true);
                    None
                }
                "mov.u32" | "mov.u64" | "mov.b64" => match (&a[0], &a[1]) {
                    (Arg::Pair(lo, hi), _) => {
                        let x = v(1, r);
                        r[*lo] = x & 0xFFFF_FFFF;
                        r[*hi] = x >> 32;
                        None
                    }
                    (_, Arg::Pair(lo, hi)) => Some(r[*lo] | r[*hi] << 32),
                    (_, Arg::Sym(s)) if s == "warps" => Some(0),
                    _ => Some(v(1, r)),
                },
                "cvta.to.global.u64" => Some(v(1, r)),
                "cvt.u64.u32" => Some(v(1, r) & 0xFFFF_FFFF),
                "add.u64" => Some(v(1, r).wrapping_add(v(2, r))),
                "sub.u64" => Some(v(1, r).wrapping_sub(v(2, r))),
                "mul.lo.u64" => Some(v(1, r).wrapping_mul(v(2, r))),
                "mul.wide.u32" => Some((v(1, r) & 0xFFFF_FFFF) * (v(2, r) & 0xFFFF_FFFF)),
                "div.u64" => Some(v(1, r) / v(2, r)),
                "shl.b64" => Some(v(1, r) << v(2, r)),
                "shr.b64" | "shr.u32" => Some((v(1, r) & mask) >> v(2, r)),
                "and.b32" => Some(v(1, r) & v(2, r)),
                "xor.b64" => Some(v(1, r) ^ v(2, r)),
                "not.b64" => Some(!v(1, r)),
                "min.u64" => Some(v(1, r).min(v(2, r))),
                "max.u64" => Some(v(1, r).max(v(2, r))),
                "setp.ge.u64" => Some(u64::from(v(1, r) >= v(2, r))),
                "setp.lt.u64" => Some(u64::from(v(1, r) < v(2, r))),
                "setp.ne.u32" => Some(u64::from(v(1, r) & mask != v(2, r) & mask)),
                op => panic!("the interpreter does not know {op}: teach it"),
            };
            if let Some(x) = result {
                let Arg::Reg(d) = a[0] else {
                    panic!("{inst:?}")
                };
                r[d] = x & mask;
            }
            *pc += 1;
        }
    }
}

/// The device memory a block sees: the range, the launch's sums, the block's shared array.
struct Mem<'a> {
    data: &'a [u8],
    out: &'a mut [u8],
    shared: &'a mut [u8],
}

impl Mem<'_> {
    /// The 8 bytes at `a`, of the shared array or of the sums (the range is only read).
    fn at(&mut self, a: u64, shared: bool) -> &mut [u8] {
        assert_eq!(a % 8, 0, "misaligned access at {a:#x}");
        let (base, bytes) = if shared {
            (0, &mut *self.shared)
        } else {
            (OUT, &mut *self.out)
        };
        assert!(
            (base..base + bytes.len() as u64).contains(&a),
            "access outside the range, the sums and the shared array at {a:#x}"
        );
        let i = (a - base) as usize;
        &mut bytes[i..i + 8]
    }

    fn load(&mut self, a: u64, shared: bool) -> u64 {
        if !shared && (SRC..SRC + self.data.len() as u64).contains(&a) {
            let i = (a - SRC) as usize;
            return u64::from_le_bytes(self.data[i..i + 8].try_into().unwrap());
        }
        u64::from_le_bytes(self.at(a, shared)[..].try_into().unwrap())
    }

    fn store(&mut self, a: u64, x: u64, shared: bool) {
        self.at(a, shared).copy_from_slice(&x.to_le_bytes());
    }
}

fn val(a: &Arg, r: &[u64], tid: u64, ctaid: u64) -> u64 {
    match a {
        Arg::Reg(i) => r[*i],
        Arg::Imm(x) => *x,
        Arg::Tid => tid,
        Arg::Ctaid => ctaid,
        _ => panic!("not a value: {a:?}"),
    }
}

fn addr(a: &Arg, r: &[u64]) -> u64 {
    let Arg::Mem(base, off) = a else {
        panic!("not an address: {a:?}")
    };
    let base = match &**base {
        Arg::Sym(s) if s == "warps" => 0,
        b => val(b, r, 0, 0),
    };
    base.wrapping_add(*off)
}

/// Operands split at top-level commas.
fn split_args(s: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut depth = 0;
    for c in s.chars() {
        match c {
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(String::new());
                continue;
            }
            _ => {}
        }
        out.last_mut().unwrap().push(c);
    }
    out.into_iter()
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect()
}

fn parse_arg(a: &str, reg: &mut impl FnMut(&str) -> usize) -> Arg {
    if let Some(inner) = a.strip_prefix('{').and_then(|a| a.strip_suffix('}')) {
        let (lo, hi) = inner.split_once(',').unwrap();
        return Arg::Pair(reg(lo.trim()), reg(hi.trim()));
    }
    if let Some(inner) = a.strip_prefix('[').and_then(|a| a.strip_suffix(']')) {
        let (base, off) = match inner.split_once('+') {
            Some((b, o)) => (b, o.parse().unwrap()),
            None => (inner, 0),
        };
        return Arg::Mem(Box::new(parse_arg(base, reg)), off);
    }
    match a {
        "%tid.x" => Arg::Tid,
        "%ctaid.x" => Arg::Ctaid,
        _ if a.starts_with('%') => Arg::Reg(reg(a)),
        _ if a.starts_with("0x") => Arg::Imm(u64::from_str_radix(&a[2..], 16).unwrap()),
        _ if a.starts_with('-') => Arg::Imm(a.parse::<i64>().unwrap() as u64),
        _ if a.starts_with(|c: char| c.is_ascii_digit()) => Arg::Imm(a.parse().unwrap()),
        _ => Arg::Sym(a.to_string()),
    }
}
