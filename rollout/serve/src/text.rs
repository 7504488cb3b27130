//! Tokens to text as they are sampled: incremental detokenization and stop strings.
//!
//! Each sample's text grows by decoding a small window of its latest tokens (the way vLLM
//! does: the window keeps a few tokens of context, so a tokenizer that drops a word's leading
//! space at the start of a text does not drop it here), and is given out only when it ends on
//! a whole character. With stop strings, the text that could still become one is held back,
//! and the first stop string found ends the sample there.
//!
//! Owns: the text of one sample. Never: samples, or decides when the engine stops (the caller
//! stops the engine's sample when [`SampleText::stopped`]).

use learner::tokenizer::Tokenizer;

/// Tokens of context the decoding window starts with (from the prompt's end).
const CONTEXT: usize = 5;

/// The text of one sample so far.
pub struct SampleText {
    /// The prompt's last tokens, then the sample's.
    ids: Vec<u32>,
    /// How many of `ids` are the prompt's.
    context: usize,
    /// Window start, and the end of what `text` already holds.
    prefix: usize,
    read: usize,
    /// Decoded text, whole characters only.
    text: String,
    /// Bytes of `text` given out.
    sent: usize,
    /// Tokens of the sample kept when a stop string ended it.
    stopped_at: Option<usize>,
}

/// What [`SampleText::push`] gives out: new text, and the sample's tokens it covers.
#[derive(Debug, Default, PartialEq)]
pub struct Piece {
    /// Text not given out before.
    pub text: String,
    /// Index range of the sample's tokens since the last piece.
    pub tokens: std::ops::Range<usize>,
}

/// The stop strings of a request.
pub struct Stops {
    strings: Vec<String>,
    /// Give the stop string out with the text (vLLM's `include_stop_str_in_output`).
    include: bool,
    longest: usize,
}

impl Stops {
    /// `strings` (empty ones are ignored).
    pub fn new(strings: Vec<String>, include: bool) -> Self {
        let strings: Vec<String> = strings.into_iter().filter(|s| !s.is_empty()).collect();
        let longest = strings.iter().map(String::len).max().unwrap_or(0);
        Self {
            strings,
            include,
            longest,
        }
    }
}

impl SampleText {
    /// A sample of a request whose prompt is `prompt`.
    pub fn new(prompt: &[u32]) -> Self {
        let context = &prompt[prompt.len().saturating_sub(CONTEXT)..];
        Self {
            ids: context.to_vec(),
            context: context.len(),
            prefix: 0,
            read: context.len(),
            text: String::new(),
            sent: 0,
            stopped_at: None,
        }
    }

    /// Tokens of the sample so far.
    pub fn tokens(&self) -> usize {
        self.ids.len() - self.context
    }

    /// Tokens kept when a stop string ended the sample.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped_at
    }

    /// The text given out so far (all of it once [`SampleText::finish`] ran).
    pub fn text(&self) -> &str {
        &self.text[..self.sent]
    }

    /// Adds a sampled token; the text it completes, unless a stop string is still possible.
    pub fn push(&mut self, tok: &Tokenizer, token: u32, stops: &Stops) -> Piece {
        let from = self.tokens();
        if self.stopped_at.is_some() {
            return Piece::default();
        }
        self.ids.push(token);
        self.decode(tok, false);
        self.give(stops, false, from)
    }

    /// The rest of the text once the sample has ended (an incomplete character too).
    pub fn finish(&mut self, tok: &Tokenizer, stops: &Stops) -> Piece {
        let from = self.tokens();
        if self.stopped_at.is_some() {
            return Piece::default();
        }
        self.decode(tok, true);
        self.give(stops, true, from)
    }

    /// Extends `text` with the window's new characters.
    fn decode(&mut self, tok: &Tokenizer, last: bool) {
        let (Ok(before), Ok(now)) = (
            tok.decode(&self.ids[self.prefix..self.read]),
            tok.decode(&self.ids[self.prefix..]),
        ) else {
            return;
        };
        if now.len() > before.len()
            && (last || !now.ends_with('\u{FFFD}'))
            && let Some(new) = now.get(before.len()..)
        {
            self.text.push_str(new);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
    }

    /// Gives out the text no stop string can still claim; ends the sample at a stop string.
    fn give(&mut self, stops: &Stops, last: bool, from: usize) -> Piece {
        // A stop string can start at most `longest - 1` bytes before what was held back.
        let mut start = self.sent.saturating_sub(stops.longest);
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let found = stops
            .strings
            .iter()
            .filter_map(|s| self.text[start..].find(s.as_str()).map(|i| (start + i, s)))
            .min_by_key(|&(i, _)| i);
        let end = match found {
            Some((at, s)) => {
                let cut = if stops.include { at + s.len() } else { at };
                self.text.truncate(cut);
                self.stopped_at = Some(self.tokens());
                cut.max(self.sent)
            }
            None if last => self.text.len(),
            None => {
                let mut safe = self
                    .text
                    .len()
                    .saturating_sub(stops.longest.saturating_sub(1))
                    .max(self.sent);
                while !self.text.is_char_boundary(safe) {
                    safe -= 1;
                }
                safe.max(self.sent)
            }
        };
        let text = self.text[self.sent..end].to_string();
        self.sent = end;
        Piece {
            text,
            tokens: from..self.tokens(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `builtin:arith` tokenizer: one token per character.
    fn tok() -> Tokenizer {
        Tokenizer::from_json(
            &rollout::task::arith_tokenizer_json(),
            std::path::Path::new("arith"),
        )
        .unwrap()
    }

    fn ids(t: &Tokenizer, s: &str) -> Vec<u32> {
        t.encode(s).unwrap()
    }

    /// Feeds `out` token by token; the pieces given out, then the rest at the end.
    fn run(out: &str, stops: &[&str], include: bool) -> (Vec<String>, SampleText) {
        let t = tok();
        let stops = Stops::new(stops.iter().map(|s| s.to_string()).collect(), include);
        let mut s = SampleText::new(&ids(&t, "1+2="));
        let mut pieces = Vec::new();
        for id in ids(&t, out) {
            let p = s.push(&t, id, &stops);
            pieces.push(p.text);
        }
        pieces.push(s.finish(&t, &stops).text);
        (pieces, s)
    }

    #[test]
    fn pieces_add_up_to_the_text_and_stops_cut_it() {
        struct Case {
            out: &'static str,
            stops: &'static [&'static str],
            include: bool,
            text: &'static str,
            stopped: Option<usize>,
        }
        let cases = [
            Case {
                out: "12+34",
                stops: &[],
                include: false,
                text: "12+34",
                stopped: None,
            },
            Case {
                out: "12+34",
                stops: &["+3"],
                include: false,
                text: "12",
                stopped: Some(4),
            },
            Case {
                out: "12+34",
                stops: &["+3"],
                include: true,
                text: "12+3",
                stopped: Some(4),
            },
            // The earliest stop wins, whatever the list's order.
            Case {
                out: "1234",
                stops: &["34", "23"],
                include: false,
                text: "1",
                stopped: Some(3),
            },
            // A stop string that never completes: everything comes out at the end.
            Case {
                out: "1233",
                stops: &["334"],
                include: false,
                text: "1233",
                stopped: None,
            },
        ];
        for c in cases {
            let (pieces, s) = run(c.out, c.stops, c.include);
            assert_eq!(pieces.concat(), c.text, "{}", c.out);
            assert_eq!(s.text(), c.text);
            assert_eq!(s.stopped(), c.stopped, "{}", c.out);
        }
    }

    #[test]
    fn text_that_may_become_a_stop_string_is_held_back_until_it_cannot() {
        let (pieces, _) = run("1233", &["334"], false);
        // "33" could start "334": held back until the end shows it does not.
        assert_eq!(pieces, ["", "", "1", "2", "33"]);
        let (pieces, _) = run("123", &[], false);
        assert_eq!(pieces, ["1", "2", "3", ""]);
    }

    #[test]
    fn tokens_after_a_stop_give_nothing() {
        let t = tok();
        let stops = Stops::new(vec!["2".into()], false);
        let mut s = SampleText::new(&[]);
        assert_eq!(s.push(&t, ids(&t, "1")[0], &stops).text, "1");
        let p = s.push(&t, ids(&t, "2")[0], &stops);
        assert_eq!((p.text.as_str(), p.tokens), ("", 1..2));
        assert_eq!(s.push(&t, ids(&t, "3")[0], &stops), Piece::default());
        assert_eq!(s.finish(&t, &stops), Piece::default());
        assert_eq!((s.text(), s.stopped()), ("1", Some(2)));
    }
}
