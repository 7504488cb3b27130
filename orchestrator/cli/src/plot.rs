//! `plot.png`: the run's curves (eval accuracy, reward, KL, entropy, response length, SFT loss),
//! one panel each, drawn from `metrics.jsonl` with no plotting dependency: a tiny rasteriser, a
//! 5×7 bitmap font and an uncompressed PNG writer.

use std::path::Path;

const W: usize = 1200;
const H: usize = 760;

/// Panels: (metric key, title).
pub const PANELS: &[(&str, &str)] = &[
    ("eval/accuracy", "EVAL ACCURACY"),
    ("critic/score/mean", "REWARD MEAN"),
    ("sft/loss", "SFT LOSS"),
    ("actor/ppo_kl", "PPO KL"),
    ("actor/entropy", "ENTROPY"),
    ("response_length/mean", "RESPONSE LENGTH"),
];

struct Canvas {
    px: Vec<[u8; 3]>,
}

impl Canvas {
    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            self.px[y as usize * W + x as usize] = c;
        }
    }
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: [u8; 3]) {
        let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = (x0 + t * (x1 - x0), y0 + t * (y1 - y0));
            for (dx, dy) in [(0, 0), (1, 0), (0, 1)] {
                self.set(x.round() as i64 + dx, y.round() as i64 + dy, c);
            }
        }
    }
    fn rect(&mut self, x0: usize, y0: usize, x1: usize, y1: usize, c: [u8; 3]) {
        let (a, b, cc, d) = (x0 as f64, y0 as f64, x1 as f64, y1 as f64);
        self.line((a, b), (cc, b), c);
        self.line((cc, b), (cc, d), c);
        self.line((cc, d), (a, d), c);
        self.line((a, d), (a, b), c);
    }
    fn text(&mut self, x: usize, y: usize, s: &str, c: [u8; 3]) {
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch.to_ascii_uppercase());
            for (row, bits) in g.iter().enumerate() {
                for col in 0..5 {
                    if bits >> (4 - col) & 1 == 1 {
                        for (sx, sy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                            self.set(
                                (x + i * 12 + col * 2 + sx) as i64,
                                (y + row * 2 + sy) as i64,
                                c,
                            );
                        }
                    }
                }
            }
        }
    }
}

/// 5×7 glyphs, one byte per row (low five bits).
fn glyph(c: char) -> [u8; 7] {
    match c {
        '0' => [14, 17, 19, 21, 25, 17, 14],
        '1' => [4, 12, 4, 4, 4, 4, 14],
        '2' => [14, 17, 1, 2, 4, 8, 31],
        '3' => [31, 2, 4, 2, 1, 17, 14],
        '4' => [2, 6, 10, 18, 31, 2, 2],
        '5' => [31, 16, 30, 1, 1, 17, 14],
        '6' => [6, 8, 16, 30, 17, 17, 14],
        '7' => [31, 1, 2, 4, 8, 8, 8],
        '8' => [14, 17, 17, 14, 17, 17, 14],
        '9' => [14, 17, 17, 15, 1, 2, 12],
        '.' => [0, 0, 0, 0, 0, 12, 12],
        '-' => [0, 0, 0, 31, 0, 0, 0],
        'A' => [14, 17, 17, 31, 17, 17, 17],
        'C' => [14, 17, 16, 16, 16, 17, 14],
        'D' => [28, 18, 17, 17, 17, 18, 28],
        'E' => [31, 16, 16, 30, 16, 16, 31],
        'F' => [31, 16, 16, 30, 16, 16, 16],
        'G' => [14, 17, 16, 23, 17, 17, 15],
        'H' => [17, 17, 17, 31, 17, 17, 17],
        'I' => [14, 4, 4, 4, 4, 4, 14],
        'K' => [17, 18, 20, 24, 20, 18, 17],
        'L' => [16, 16, 16, 16, 16, 16, 31],
        'M' => [17, 27, 21, 21, 17, 17, 17],
        'N' => [17, 17, 25, 21, 19, 17, 17],
        'O' => [14, 17, 17, 17, 17, 17, 14],
        'P' => [30, 17, 17, 30, 16, 16, 16],
        'R' => [30, 17, 17, 30, 20, 18, 17],
        'S' => [15, 16, 16, 14, 1, 1, 30],
        'T' => [31, 4, 4, 4, 4, 4, 4],
        'U' => [17, 17, 17, 17, 17, 17, 14],
        'V' => [17, 17, 17, 17, 17, 10, 4],
        'W' => [17, 17, 17, 21, 21, 21, 10],
        'X' => [17, 17, 10, 4, 10, 17, 17],
        'Y' => [17, 17, 10, 4, 4, 4, 4],
        'Z' => [31, 1, 2, 4, 8, 16, 31],
        'B' => [30, 17, 17, 30, 17, 17, 30],
        'J' => [7, 2, 2, 2, 2, 18, 12],
        'Q' => [14, 17, 17, 17, 21, 18, 13],
        _ => [0; 7],
    }
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn png(canvas: &Canvas) -> Vec<u8> {
    let mut raw = Vec::with_capacity(H * (W * 3 + 1));
    for y in 0..H {
        raw.push(0);
        for x in 0..W {
            raw.extend_from_slice(&canvas.px[y * W + x]);
        }
    }
    // zlib stream of stored (uncompressed) deflate blocks
    let mut z = vec![0x78, 0x01];
    for (i, block) in raw.chunks(65535).enumerate() {
        let last = (i + 1) * 65535 >= raw.len();
        z.push(u8::from(last));
        let len = block.len() as u16;
        z.extend_from_slice(&len.to_le_bytes());
        z.extend_from_slice(&(!len).to_le_bytes());
        z.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &v in &raw {
        a = (a + v as u32) % 65521;
        b = (b + a) % 65521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    let mut chunk = |kind: &[u8], data: &[u8]| {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend_from_slice(data);
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32(&body).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(W as u32).to_be_bytes());
    ihdr.extend_from_slice(&(H as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &z);
    chunk(b"IEND", &[]);
    out
}

fn label(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Draws the curves of `RUN_DIR/metrics.jsonl` into `out` (x: steps of all stages in order).
pub fn plot(run_dir: &Path, out: &Path) -> Result<(), String> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if rows.is_empty() {
        return Err(format!("{}: no metrics to plot", path.display()));
    }
    let mut c = Canvas {
        px: vec![[255, 255, 255]; W * H],
    };
    let (cols, rws) = (3, 2);
    let (pw, ph) = (W / cols, H / rws);
    for (p, (key, title)) in PANELS.iter().enumerate() {
        let (ox, oy) = ((p % cols) * pw, (p / cols) * ph);
        let (x0, y0, x1, y1) = (ox + 84, oy + 40, ox + pw - 24, oy + ph - 40);
        c.text(x0, oy + 12, title, [0, 0, 0]);
        c.rect(x0, y0, x1, y1, [150, 150, 150]);
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.get(*key).and_then(|v| v.as_f64()).map(|v| (i as f64, v)))
            .collect();
        if pts.is_empty() {
            c.text(x0 + 20, y0 + 20, "NO DATA", [150, 150, 150]);
            continue;
        }
        let (lo, hi) = pts
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let (lo, hi) = if hi - lo < 1e-12 {
            (lo - 0.5, hi + 0.5)
        } else {
            (lo, hi)
        };
        let n = (rows.len() - 1).max(1) as f64;
        let map = |(i, v): (f64, f64)| {
            (
                x0 as f64 + 4.0 + i / n * (x1 - x0 - 8) as f64,
                y1 as f64 - 4.0 - (v - lo) / (hi - lo) * (y1 - y0 - 8) as f64,
            )
        };
        for w in pts.windows(2) {
            c.line(map(w[0]), map(w[1]), [31, 119, 180]);
        }
        if pts.len() == 1 {
            let (x, y) = map(pts[0]);
            c.line((x - 3.0, y), (x + 3.0, y), [31, 119, 180]);
        }
        c.text(ox + 2, y0, &label(hi), [80, 80, 80]);
        c.text(ox + 2, y1 - 14, &label(lo), [80, 80, 80]);
        c.text(
            x1 - 12 * (rows.len().to_string().len() + 6),
            y1 + 8,
            &format!("{} STEPS", rows.len()),
            [80, 80, 80],
        );
    }
    std::fs::write(out, png(&c)).map_err(|e| format!("{}: {e}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_valid_png() {
        let dir = std::env::temp_dir().join(format!("trellis-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lines: Vec<String> = (1..=20)
            .map(|s| format!("{{\"stage\":\"rl\",\"step\":{s},\"critic/score/mean\":{},\"eval/accuracy\":{}}}", s as f64 / 20.0, s as f64 / 40.0))
            .collect();
        std::fs::write(dir.join("metrics.jsonl"), lines.join("\n")).unwrap();
        let out = dir.join("plot.png");
        plot(&dir, &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(
            &bytes[..8],
            &[0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A]
        );
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
