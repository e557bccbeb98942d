//! VADER sentiment analysis, ported line by line from the reference Python implementation
//! (`vaderSentiment` 3.3.2 on PyPI, C.J. Hutto, MIT licence: see `LICENSE-vaderSentiment.txt`
//! beside this file).
//!
//! # Why a port
//! The `vader_sentiment` 0.1.1 crate diverges from vaderSentiment 3.3.2: it does not round
//! the compound score to 4 decimals as Python does, and it scores booster words
//! ("very", "really", "extremely", ...) differently (e.g. "The food is very great." gives
//! 0.6894 there and 0.659 in Python). CheckList tests compare scores under a tolerance, so
//! the embedded model must be exactly the published one. `vader_lexicon.txt` and
//! `emoji_utf8_lexicon.txt` are vendored byte for byte from the 3.3.2 wheel.
//!
//! # Parity
//! Every rule follows the Python source, quirks included: `_but_check` looks values up
//! with `list.index` (first equal value), tokens are split on Python's whitespace set and
//! stripped of ASCII punctuation, `isupper` follows Python's definition, and the scores are
//! rounded like Python's `round(x, 4)` (correctly rounded, ties to even).
//! `tests/generate.rs` checks the compound score of every sentence of
//! `pipelines/sentiment.toml` against a fixture made by `scripts/vader_reference.py`.

use std::collections::HashMap;
use std::sync::OnceLock;

const B_INCR: f64 = 0.293;
const B_DECR: f64 = -0.293;
const C_INCR: f64 = 0.733;
const N_SCALAR: f64 = -0.74;

const NEGATE: &[&str] = &[
    "aint",
    "arent",
    "cannot",
    "cant",
    "couldnt",
    "darent",
    "didnt",
    "doesnt",
    "ain't",
    "aren't",
    "can't",
    "couldn't",
    "daren't",
    "didn't",
    "doesn't",
    "dont",
    "hadnt",
    "hasnt",
    "havent",
    "isnt",
    "mightnt",
    "mustnt",
    "neither",
    "don't",
    "hadn't",
    "hasn't",
    "haven't",
    "isn't",
    "mightn't",
    "mustn't",
    "neednt",
    "needn't",
    "never",
    "none",
    "nope",
    "nor",
    "not",
    "nothing",
    "nowhere",
    "oughtnt",
    "shant",
    "shouldnt",
    "uhuh",
    "wasnt",
    "werent",
    "oughtn't",
    "shan't",
    "shouldn't",
    "uh-uh",
    "wasn't",
    "weren't",
    "without",
    "wont",
    "wouldnt",
    "won't",
    "wouldn't",
    "rarely",
    "seldom",
    "despite",
];

const BOOSTERS_INCR: &[&str] = &[
    "absolutely",
    "amazingly",
    "awfully",
    "completely",
    "considerable",
    "considerably",
    "decidedly",
    "deeply",
    "effing",
    "enormous",
    "enormously",
    "entirely",
    "especially",
    "exceptional",
    "exceptionally",
    "extreme",
    "extremely",
    "fabulously",
    "flipping",
    "flippin",
    "frackin",
    "fracking",
    "fricking",
    "frickin",
    "frigging",
    "friggin",
    "fully",
    "fuckin",
    "fucking",
    "fuggin",
    "fugging",
    "greatly",
    "hella",
    "highly",
    "hugely",
    "incredible",
    "incredibly",
    "intensely",
    "major",
    "majorly",
    "more",
    "most",
    "particularly",
    "purely",
    "quite",
    "really",
    "remarkably",
    "so",
    "substantially",
    "thoroughly",
    "total",
    "totally",
    "tremendous",
    "tremendously",
    "uber",
    "unbelievably",
    "unusually",
    "utter",
    "utterly",
    "very",
];

const BOOSTERS_DECR: &[&str] = &[
    "almost",
    "barely",
    "hardly",
    "just enough",
    "kind of",
    "kinda",
    "kindof",
    "kind-of",
    "less",
    "little",
    "marginal",
    "marginally",
    "occasional",
    "occasionally",
    "partly",
    "scarce",
    "scarcely",
    "slight",
    "slightly",
    "somewhat",
    "sort of",
    "sorta",
    "sortof",
    "sort-of",
];

const SPECIAL_CASES: &[(&str, f64)] = &[
    ("the shit", 3.0),
    ("the bomb", 3.0),
    ("bad ass", 1.5),
    ("badass", 1.5),
    ("bus stop", 0.0),
    ("yeah right", -2.0),
    ("kiss of death", -1.5),
    ("to die for", 3.0),
    ("beating heart", 3.5),
];

const LEXICON_TXT: &str = include_str!("vader_lexicon.txt");
const EMOJI_TXT: &str = include_str!("emoji_utf8_lexicon.txt");

fn booster(word: &str) -> Option<f64> {
    if BOOSTERS_INCR.contains(&word) {
        Some(B_INCR)
    } else if BOOSTERS_DECR.contains(&word) {
        Some(B_DECR)
    } else {
        None
    }
}

fn special_case(seq: &str) -> Option<f64> {
    SPECIAL_CASES
        .iter()
        .find(|(k, _)| *k == seq)
        .map(|(_, v)| *v)
}

/// Python's `str.isspace` set: Unicode White_Space plus the ASCII separators U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Unicode general category Lt (titlecase letters), which Python's `isupper` rejects.
fn is_titlecase(c: char) -> bool {
    matches!(c,
        '\u{01C5}' | '\u{01C8}' | '\u{01CB}' | '\u{01F2}'
        | '\u{1F88}'..='\u{1F8F}' | '\u{1F98}'..='\u{1F9F}' | '\u{1FA8}'..='\u{1FAF}'
        | '\u{1FBC}' | '\u{1FCC}' | '\u{1FFC}')
}

/// Python's `str.isupper`: at least one cased character and none lowercase or titlecase.
fn py_isupper(s: &str) -> bool {
    let mut cased = false;
    for c in s.chars() {
        if c.is_lowercase() || is_titlecase(c) {
            return false;
        }
        if c.is_uppercase() {
            cased = true;
        }
    }
    cased
}

/// Python's `round(x, n)`: correctly rounded to `n` decimals (ties to even on the exact
/// binary value), read back as the nearest float.
pub fn py_round(x: f64, n: usize) -> f64 {
    if !x.is_finite() {
        return x;
    }
    // Rust's fixed-precision formatting is exact and rounds ties to even, as CPython's
    // `_Py_dg_dtoa` mode 3 does.
    let r: f64 = format!("{x:.n$}").parse().expect("formatted float parses");
    if r == 0.0 { 0.0f64.copysign(x) } else { r }
}

/// The four scores of `SentimentIntensityAnalyzer.polarity_scores`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Polarity {
    pub neg: f64,
    pub neu: f64,
    pub pos: f64,
    pub compound: f64,
}

/// A VADER analyser with its lexicons loaded.
pub struct Analyzer {
    lexicon: HashMap<String, f64>,
    emojis: HashMap<char, String>,
}

impl Default for Analyzer {
    fn default() -> Self {
        Self::new()
    }
}

/// The shared analyser (the lexicon is parsed once per process).
pub fn analyzer() -> &'static Analyzer {
    static A: OnceLock<Analyzer> = OnceLock::new();
    A.get_or_init(Analyzer::new)
}

/// VADER's compound score for `text`, as vaderSentiment 3.3.2 reports it.
pub fn compound(text: &str) -> f64 {
    analyzer().polarity_scores(text).compound
}

impl Analyzer {
    /// Loads the vendored lexicons (`make_lex_dict`, `make_emoji_dict`).
    pub fn new() -> Self {
        let mut lexicon = HashMap::new();
        for line in LEXICON_TXT.trim_end_matches('\n').split('\n') {
            if line.is_empty() {
                continue;
            }
            let mut parts = line.trim_matches(py_space).split('\t');
            let (Some(word), Some(measure)) = (parts.next(), parts.next()) else {
                continue;
            };
            lexicon.insert(
                word.to_string(),
                measure
                    .parse::<f64>()
                    .expect("vader_lexicon.txt measures are floats"),
            );
        }
        let mut emojis = HashMap::new();
        for line in EMOJI_TXT.trim_end_matches('\n').split('\n') {
            let mut parts = line.trim_matches(py_space).split('\t');
            let (Some(emoji), Some(desc)) = (parts.next(), parts.next()) else {
                continue;
            };
            // Python tests one character at a time, so only one-character keys can match.
            let mut cs = emoji.chars();
            if let (Some(c), None) = (cs.next(), cs.next()) {
                emojis.insert(c, desc.to_string());
            }
        }
        Self { lexicon, emojis }
    }

    fn in_lexicon(&self, w: &str) -> bool {
        self.lexicon.contains_key(w)
    }

    /// `polarity_scores`: negative, neutral, positive proportions and the compound score.
    pub fn polarity_scores(&self, text: &str) -> Polarity {
        // Emojis become their textual descriptions.
        let mut no_emoji = String::with_capacity(text.len());
        let mut prev_space = true;
        for c in text.chars() {
            if let Some(desc) = self.emojis.get(&c) {
                if !prev_space {
                    no_emoji.push(' ');
                }
                no_emoji.push_str(desc);
                prev_space = false;
            } else {
                no_emoji.push(c);
                prev_space = c == ' ';
            }
        }
        let text = no_emoji.trim_matches(py_space);

        // SentiText: split on whitespace, strip punctuation unless that leaves <= 2 chars.
        let words: Vec<&str> = text
            .split(py_space)
            .filter(|w| !w.is_empty())
            .map(|tok| {
                let stripped = tok.trim_matches(|c: char| c.is_ascii_punctuation());
                if stripped.chars().count() <= 2 {
                    tok
                } else {
                    stripped
                }
            })
            .collect();
        let lower: Vec<String> = words.iter().map(|w| w.to_lowercase()).collect();
        let allcaps = words.iter().filter(|w| py_isupper(w)).count();
        let cap_differential = words.len() - allcaps;
        let is_cap_diff = 0 < cap_differential && cap_differential < words.len();

        let mut sentiments: Vec<f64> = Vec::with_capacity(words.len());
        for i in 0..words.len() {
            if booster(&lower[i]).is_some() {
                sentiments.push(0.0);
                continue;
            }
            if i < words.len() - 1 && lower[i] == "kind" && lower[i + 1] == "of" {
                sentiments.push(0.0);
                continue;
            }
            sentiments.push(self.sentiment_valence(&words, &lower, is_cap_diff, i));
        }
        but_check(&lower, &mut sentiments);
        score_valence(&sentiments, text)
    }

    fn sentiment_valence(&self, words: &[&str], lower: &[String], cap_diff: bool, i: usize) -> f64 {
        let item = words[i];
        let Some(&base) = self.lexicon.get(&lower[i]) else {
            return 0.0;
        };
        let mut valence = base;
        if lower[i] == "no" && i != words.len() - 1 && self.in_lexicon(&lower[i + 1]) {
            valence = 0.0;
        }
        if (i > 0 && lower[i - 1] == "no")
            || (i > 1 && lower[i - 2] == "no")
            || (i > 2 && lower[i - 3] == "no" && (lower[i - 1] == "or" || lower[i - 1] == "nor"))
        {
            valence = base * N_SCALAR;
        }
        if py_isupper(item) && cap_diff {
            if valence > 0.0 {
                valence += C_INCR;
            } else {
                valence -= C_INCR;
            }
        }
        for start_i in 0..3 {
            if i > start_i && !self.in_lexicon(&lower[i - (start_i + 1)]) {
                let mut s = scalar_inc_dec(
                    words[i - (start_i + 1)],
                    &lower[i - (start_i + 1)],
                    valence,
                    cap_diff,
                );
                if start_i == 1 && s != 0.0 {
                    s *= 0.95;
                }
                if start_i == 2 && s != 0.0 {
                    s *= 0.9;
                }
                valence += s;
                valence = negation_check(valence, lower, start_i, i);
                if start_i == 2 {
                    valence = special_idioms_check(valence, lower, i);
                }
            }
        }
        self.least_check(valence, lower, i)
    }

    fn least_check(&self, valence: f64, lower: &[String], i: usize) -> f64 {
        if i > 1 && !self.in_lexicon(&lower[i - 1]) && lower[i - 1] == "least" {
            if lower[i - 2] != "at" && lower[i - 2] != "very" {
                return valence * N_SCALAR;
            }
        } else if i > 0 && !self.in_lexicon(&lower[i - 1]) && lower[i - 1] == "least" {
            return valence * N_SCALAR;
        }
        valence
    }
}

fn negated(word: &str) -> bool {
    NEGATE.contains(&word) || word.contains("n't")
}

fn scalar_inc_dec(word: &str, word_lower: &str, valence: f64, cap_diff: bool) -> f64 {
    let Some(mut scalar) = booster(word_lower) else {
        return 0.0;
    };
    if valence < 0.0 {
        scalar *= -1.0;
    }
    if py_isupper(word) && cap_diff {
        if valence > 0.0 {
            scalar += C_INCR;
        } else {
            scalar -= C_INCR;
        }
    }
    scalar
}

fn negation_check(valence: f64, w: &[String], start_i: usize, i: usize) -> f64 {
    match start_i {
        0 => {
            if negated(&w[i - 1]) {
                return valence * N_SCALAR;
            }
        }
        1 => {
            if w[i - 2] == "never" && (w[i - 1] == "so" || w[i - 1] == "this") {
                return valence * 1.25;
            } else if w[i - 2] == "without" && w[i - 1] == "doubt" {
                return valence;
            } else if negated(&w[i - 2]) {
                return valence * N_SCALAR;
            }
        }
        _ => {
            // Python: `a and (b or c) or (d or e)`, `and` binding tighter.
            if (w[i - 3] == "never" && (w[i - 2] == "so" || w[i - 2] == "this"))
                || (w[i - 1] == "so" || w[i - 1] == "this")
            {
                return valence * 1.25;
            } else if w[i - 3] == "without" && (w[i - 2] == "doubt" || w[i - 1] == "doubt") {
                return valence;
            } else if negated(&w[i - 3]) {
                return valence * N_SCALAR;
            }
        }
    }
    valence
}

fn special_idioms_check(mut valence: f64, w: &[String], i: usize) -> f64 {
    let onezero = format!("{} {}", w[i - 1], w[i]);
    let twoonezero = format!("{} {} {}", w[i - 2], w[i - 1], w[i]);
    let twoone = format!("{} {}", w[i - 2], w[i - 1]);
    let threetwoone = format!("{} {} {}", w[i - 3], w[i - 2], w[i - 1]);
    let threetwo = format!("{} {}", w[i - 3], w[i - 2]);
    for seq in [&onezero, &twoonezero, &twoone, &threetwoone, &threetwo] {
        if let Some(v) = special_case(seq) {
            valence = v;
            break;
        }
    }
    if w.len() - 1 > i
        && let Some(v) = special_case(&format!("{} {}", w[i], w[i + 1]))
    {
        valence = v;
    }
    if w.len() - 1 > i + 1
        && let Some(v) = special_case(&format!("{} {} {}", w[i], w[i + 1], w[i + 2]))
    {
        valence = v;
    }
    for n_gram in [&threetwoone, &threetwo, &twoone] {
        if let Some(b) = booster(n_gram) {
            valence += b;
        }
    }
    valence
}

/// `_but_check`, including its use of `list.index` (the first element equal to the
/// current value is the one rescaled), which matters when two words share a valence.
fn but_check(lower: &[String], sentiments: &mut [f64]) {
    let Some(bi) = lower.iter().position(|w| w == "but") else {
        return;
    };
    for k in 0..sentiments.len() {
        let s = sentiments[k];
        let si = sentiments
            .iter()
            .position(|x| *x == s)
            .expect("the value is in the list");
        if si < bi {
            sentiments[si] = s * 0.5;
        } else if si > bi {
            sentiments[si] = s * 1.5;
        }
    }
}

fn punctuation_emphasis(text: &str) -> f64 {
    let ep = text.matches('!').count().min(4);
    let ep_amplifier = ep as f64 * 0.292;
    let qm = text.matches('?').count();
    let qm_amplifier = if qm > 1 {
        if qm <= 3 { qm as f64 * 0.18 } else { 0.96 }
    } else {
        0.0
    };
    ep_amplifier + qm_amplifier
}

fn normalize(score: f64) -> f64 {
    let n = score / (score * score + 15.0).sqrt();
    n.clamp(-1.0, 1.0)
}

fn score_valence(sentiments: &[f64], text: &str) -> Polarity {
    if sentiments.is_empty() {
        return Polarity {
            neg: 0.0,
            neu: 0.0,
            pos: 0.0,
            compound: 0.0,
        };
    }
    let mut sum_s: f64 = sentiments.iter().fold(0.0, |a, b| a + b);
    let amp = punctuation_emphasis(text);
    if sum_s > 0.0 {
        sum_s += amp;
    } else if sum_s < 0.0 {
        sum_s -= amp;
    }
    let compound = normalize(sum_s);
    let (mut pos_sum, mut neg_sum, mut neu_count) = (0.0f64, 0.0f64, 0u64);
    for &s in sentiments {
        if s > 0.0 {
            pos_sum += s + 1.0;
        }
        if s < 0.0 {
            neg_sum += s - 1.0;
        }
        if s == 0.0 {
            neu_count += 1;
        }
    }
    if pos_sum > neg_sum.abs() {
        pos_sum += amp;
    } else if pos_sum < neg_sum.abs() {
        neg_sum -= amp;
    }
    let total = pos_sum + neg_sum.abs() + neu_count as f64;
    Polarity {
        neg: py_round((neg_sum / total).abs(), 3),
        neu: py_round((neu_count as f64 / total).abs(), 3),
        pos: py_round((pos_sum / total).abs(), 3),
        compound: py_round(compound, 4),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The examples in vaderSentiment.py's `__main__`, scored by vaderSentiment 3.3.2.
    #[test]
    fn reference_examples() {
        let cases = [
            ("VADER is smart, handsome, and funny.", 0.8316),
            ("VADER is smart, handsome, and funny!", 0.8439),
            ("VADER is very smart, handsome, and funny.", 0.8545),
            ("VADER is VERY SMART, handsome, and FUNNY.", 0.9227),
            ("VADER is VERY SMART, handsome, and FUNNY!!!", 0.9342),
            (
                "VADER is VERY SMART, uber handsome, and FRIGGIN FUNNY!!!",
                0.9469,
            ),
            ("VADER is not smart, handsome, nor funny.", -0.7424),
            ("The book was good.", 0.4404),
            ("At least it isn't a horrible book.", 0.431),
            ("The book was only kind of good.", 0.3832),
            (
                "The plot was good, but the characters are uncompelling and the dialog is not great.",
                -0.7042,
            ),
            ("Today SUX!", -0.5461),
            ("Today only kinda sux! But I'll get by, lol", 0.5249),
            ("Make sure you :) or :D today!", 0.8633),
            ("Catch utf-8 emoji such as 💘 and 💋 and 😁", 0.875),
            ("Not bad at all", 0.431),
        ];
        for (text, want) in cases {
            assert_eq!(compound(text), want, "{text}");
        }
    }

    #[test]
    fn python_round_ties_to_even() {
        assert_eq!(py_round(0.03125, 4), 0.0312);
        assert_eq!(py_round(0.09375, 4), 0.0938);
        assert_eq!(py_round(0.62489332, 4), 0.6249);
        assert_eq!(py_round(-0.00001, 4), -0.0);
    }

    #[test]
    fn isupper_like_python() {
        assert!(py_isupper("SUX!"));
        assert!(!py_isupper(":)"));
        assert!(!py_isupper("Sux"));
        assert!(py_isupper("A1"));
    }
}
