//! `plot.png`: the run's curves (eval accuracy, reward, KL, entropy, response length, SFT loss),
//! one panel each, drawn from `metrics.jsonl` with no plotting dependency: a tiny rasteriser, a
//! 5×7 bitmap font and a PNG writer (the image data deflated by `miniz_oxide`). The x axis runs
//! over every stage's steps in order; each stage's start is marked with a dashed line, and under
//! the axis each stage is named with its last step.

use std::path::Path;

const W: usize = 1200;
const H: usize = 760;

/// Panels: (metric keys, the first present drawn; title).
pub const PANELS: &[(&[&str], &str)] = &[
    (&["eval/accuracy"], "EVAL ACCURACY"),
    (&["critic/score/mean"], "REWARD MEAN"),
    (&["sft/loss"], "SFT LOSS"),
    // The KL loss to the reference when the run has one; PPO's KL is 0 with one update a batch.
    (&["actor/kl_loss", "actor/ppo_kl"], "KL"),
    (&["actor/entropy"], "ENTROPY"),
    (&["response_length/mean"], "RESPONSE LENGTH"),
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
        '_' => [0, 0, 0, 0, 0, 0, 31],
        '/' => [1, 1, 2, 4, 8, 16, 16],
        ':' => [0, 12, 12, 0, 12, 12, 0],
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
    // The image data as a zlib stream (a few large flat areas and lines: it deflates ~100×).
    let z = miniz_oxide::deflate::compress_to_vec_zlib(&raw, 6);
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
    // Each stage's rows (first row index, id, last step).
    let mut stages: Vec<(usize, String, u64)> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let id = r.get("stage").and_then(|s| s.as_str()).unwrap_or("");
        let step = r.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        match stages.last_mut() {
            Some((_, last, s)) if last == id => *s = step,
            _ => stages.push((i, id.to_string(), step)),
        }
    }
    let (cols, rws) = (3, 2);
    let (pw, ph) = (W / cols, H / rws);
    for (p, (keys, title)) in PANELS.iter().enumerate() {
        let (ox, oy) = ((p % cols) * pw, (p / cols) * ph);
        let (x0, y0, x1, y1) = (ox + 84, oy + 40, ox + pw - 24, oy + ph - 40);
        let key = keys
            .iter()
            .find(|k| rows.iter().any(|r| r.get(**k).is_some()))
            .unwrap_or(&keys[0]);
        c.text(x0, oy + 12, title, [0, 0, 0]);
        c.rect(x0, y0, x1, y1, [150, 150, 150]);
        let n = (rows.len() - 1).max(1) as f64;
        let xat = |i: f64| x0 as f64 + 4.0 + i / n * (x1 - x0 - 8) as f64;
        // Stage boundaries: a dashed line where a stage starts; under the axis, each stage's id
        // and its last step, as much of it as its span has room for.
        for (k, (i, id, last)) in stages.iter().enumerate() {
            let x = xat(*i as f64).round();
            if k > 0 {
                let mut y = y0 as f64;
                while y < y1 as f64 {
                    c.line((x, y), (x, (y + 5.0).min(y1 as f64)), [190, 190, 190]);
                    y += 10.0;
                }
            }
            let end = stages
                .get(k + 1)
                .map_or(x1 as f64, |(j, _, _)| xat(*j as f64));
            let room = ((end - x) / 12.0).floor().max(0.0) as usize;
            let full = format!("{id} {last}");
            let shown = if full.len() < room {
                full
            } else if id.len() < room {
                id.clone()
            } else {
                String::new()
            };
            c.text(x as usize + 2, y1 + 8, &shown, [80, 80, 80]);
        }
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
        let map = |(i, v): (f64, f64)| {
            (
                xat(i),
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
    }
    std::fs::write(out, png(&c)).map_err(|e| format!("{}: {e}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plot_is_small_and_marks_where_stages_start() {
        let dir = std::env::temp_dir().join(format!("trellis-plot-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A run shaped like grpo-arith: 550 SFT steps, 180 RL steps, an eval.
        let mut lines = Vec::new();
        for s in 1..=550 {
            lines.push(format!(
                "{{\"stage\":\"warmup\",\"step\":{s},\"sft/loss\":{}}}",
                2.0 / (1.0 + s as f64 / 50.0)
            ));
        }
        for s in 1..=180 {
            lines.push(format!(
                "{{\"stage\":\"rl\",\"step\":{s},\"critic/score/mean\":{},\"actor/entropy\":{},\"response_length/mean\":{}}}",
                (s as f64 / 200.0).sin(),
                1.0 - s as f64 / 300.0,
                3.0 + (s % 7) as f64 / 7.0
            ));
        }
        lines.push("{\"stage\":\"final-eval\",\"step\":0,\"eval/accuracy\":0.885}".into());
        std::fs::write(dir.join("metrics.jsonl"), lines.join("\n")).unwrap();
        let out = dir.join("plot.png");
        plot(&dir, &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert!(bytes.len() < 100_000, "{} bytes", bytes.len());
        // Decoded back, the image holds the dashed boundary's grey where the RL stage starts.
        let idat = bytes
            .windows(4)
            .position(|w| w == b"IDAT")
            .expect("an IDAT chunk");
        let len = u32::from_be_bytes(bytes[idat - 4..idat].try_into().unwrap()) as usize;
        let raw =
            miniz_oxide::inflate::decompress_to_vec_zlib(&bytes[idat + 4..idat + 4 + len]).unwrap();
        assert_eq!(raw.len(), H * (W * 3 + 1));
        let px = |x: usize, y: usize| {
            let o = y * (W * 3 + 1) + 1 + x * 3;
            [raw[o], raw[o + 1], raw[o + 2]]
        };
        // First panel: x0 = 84, x1 = 376, y0 = 40; the RL stage starts at row 550 of 731.
        let x = (84.0 + 4.0 + 550.0 / 730.0 * (376.0 - 84.0 - 8.0_f64)).round() as usize;
        let grey = (41..100).filter(|&y| px(x, y) == [190, 190, 190]).count();
        assert!(grey > 10, "{grey} boundary pixels at x = {x}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
