//! Named, seed-reproducible perturbations for INV and DIR tests (CheckList's
//! `Perturb` library): each maps a base text to a variant, or `None` when it does not apply
//! (a name swap on a sentence with no name), in which case no perturbed case is made.

use rand::Rng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;

use crate::pipeline::PerturbSpec;

/// Built-in word lists, usable as lexicons in templates and by the swap perturbations.
pub const MALE_NAMES: &[&str] = &[
    "John", "Michael", "David", "James", "Robert", "William", "Daniel", "Thomas", "Kevin", "Brian",
    "Ahmed", "Carlos", "Hiroshi", "Raj", "Kwame", "Ivan",
];
pub const FEMALE_NAMES: &[&str] = &[
    "Mary",
    "Jennifer",
    "Linda",
    "Elizabeth",
    "Susan",
    "Sarah",
    "Emily",
    "Laura",
    "Anna",
    "Maria",
    "Fatima",
    "Mei",
    "Priya",
    "Aisha",
    "Olga",
    "Sofia",
];
pub const CITIES: &[&str] = &[
    "Chicago", "Boston", "Seattle", "Denver", "Houston", "Atlanta", "London", "Paris", "Berlin",
    "Madrid", "Toronto", "Sydney", "Mumbai", "Lagos", "Tokyo", "Havana",
];
pub const COUNTRIES: &[&str] = &[
    "Canada",
    "Cuba",
    "France",
    "Germany",
    "Spain",
    "Italy",
    "Japan",
    "Brazil",
    "Mexico",
    "India",
    "Nigeria",
    "Egypt",
    "Australia",
    "Sweden",
    "Kenya",
    "Peru",
];

/// Names of the built-in lexicons, usable in any template.
pub const BUILTIN_LEXICONS: &[&str] =
    &["first_name", "male_name", "female_name", "city", "country"];

/// The built-in lexicon called `name`, if there is one.
pub fn builtin_lexicon(name: &str) -> Option<Vec<String>> {
    let v: Vec<&str> = match name {
        "male_name" => MALE_NAMES.to_vec(),
        "female_name" => FEMALE_NAMES.to_vec(),
        "first_name" => MALE_NAMES.iter().chain(FEMALE_NAMES).copied().collect(),
        "city" => CITIES.to_vec(),
        "country" => COUNTRIES.to_vec(),
        _ => return None,
    };
    Some(v.into_iter().map(String::from).collect())
}

/// Every perturbation name accepted in a suite. `rephrase` asks a model (see
/// [`super::rephrase`]); the others are pure functions of the text and a seeded rng.
pub const OPERATORS: &[&str] = &[
    "name_swap",
    "city_swap",
    "country_swap",
    "typos",
    "typo_swap",
    "typo_drop",
    "typo_insert",
    "add_suffix",
    "add_prefix",
    "remove_phrase",
    "contract",
    "expand_contractions",
    "punctuation",
    "change_number",
    "add_negation",
    "remove_negation",
    "rephrase",
];

/// Operators that need options: (name, option that must be non-empty).
pub const NEEDS_PHRASES: &[&str] = &["add_suffix", "add_prefix", "remove_phrase"];

/// Auxiliaries after which `add_negation` inserts "not" (and `remove_negation` removes it).
const AUXILIARIES: &[&str] = &[
    "is", "was", "are", "were", "am", "will", "would", "can", "could", "should", "must", "has",
    "have", "had", "Is", "Was", "Are", "Were",
];

/// Negated forms that `remove_negation` turns back into the positive.
const NEGATED: &[(&str, &str)] = &[
    ("don't", ""),
    ("doesn't", ""),
    ("didn't", ""),
    ("do not", ""),
    ("does not", ""),
    ("did not", ""),
    ("isn't", "is"),
    ("wasn't", "was"),
    ("aren't", "are"),
    ("weren't", "were"),
    ("won't", "will"),
    ("can't", "can"),
    ("is not", "is"),
    ("was not", "was"),
    ("are not", "are"),
    ("were not", "were"),
    ("will not", "will"),
    ("cannot", "can"),
];

const CONTRACTIONS: &[(&str, &str)] = &[
    ("is not", "isn't"),
    ("are not", "aren't"),
    ("was not", "wasn't"),
    ("were not", "weren't"),
    ("do not", "don't"),
    ("does not", "doesn't"),
    ("did not", "didn't"),
    ("can not", "can't"),
    ("cannot", "can't"),
    ("will not", "won't"),
    ("would not", "wouldn't"),
    ("I am", "I'm"),
    ("it is", "it's"),
    ("It is", "It's"),
    ("they are", "they're"),
    ("we are", "we're"),
    ("you are", "you're"),
    ("You are", "You're"),
];

/// Applies `spec` to `text` with `rng`; `None` when the perturbation does not apply.
pub fn apply(spec: &PerturbSpec, text: &str, rng: &mut SmallRng) -> Option<String> {
    let (count, phrases) = match spec {
        PerturbSpec::Name(_) => (None, &[][..]),
        PerturbSpec::Table { count, phrases, .. } => (*count, phrases.as_slice()),
    };
    let out = match spec.op() {
        "name_swap" => swap_gendered_name(text, rng),
        "city_swap" => swap_word_from(text, CITIES, rng),
        "country_swap" => swap_word_from(text, COUNTRIES, rng),
        "typos" => Some(typos(text, count.unwrap_or(1), None, rng)),
        "typo_swap" => Some(typos(text, count.unwrap_or(1), Some(0), rng)),
        "typo_drop" => Some(typos(text, count.unwrap_or(1), Some(1), rng)),
        "typo_insert" => Some(typos(text, count.unwrap_or(1), Some(2), rng)),
        "remove_phrase" => remove_phrase(text, phrases),
        "add_negation" => add_negation(text),
        "remove_negation" => remove_negation(text),
        "add_suffix" => phrases
            .choose(rng)
            .map(|p| format!("{} {}", text.trim_end(), p)),
        "add_prefix" => phrases
            .choose(rng)
            .map(|p| format!("{} {}", p, text.trim_start())),
        "contract" => replace_first(text, CONTRACTIONS.iter().map(|(a, b)| (*a, *b))),
        "expand_contractions" => replace_first(text, CONTRACTIONS.iter().map(|(a, b)| (*b, *a))),
        "punctuation" => Some(punctuation(text, rng)),
        "change_number" => change_number(text, rng),
        _ => None,
    }?;
    (out != text).then_some(out)
}

fn is_word_boundary(text: &str, start: usize, end: usize) -> bool {
    let before = text[..start].chars().next_back();
    let after = text[end..].chars().next();
    !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric)
}

fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find(word) {
        let s = from + i;
        if is_word_boundary(text, s, s + word.len()) {
            return Some(s);
        }
        from = s + word.len();
    }
    None
}

fn swap_word_from(text: &str, list: &[&str], rng: &mut SmallRng) -> Option<String> {
    let (pos, found) = list
        .iter()
        .filter_map(|w| find_word(text, w).map(|p| (p, *w)))
        .min_by_key(|(p, _)| *p)?;
    let others: Vec<&&str> = list.iter().filter(|w| **w != found).collect();
    let repl = others.choose(rng)?;
    Some(format!(
        "{}{}{}",
        &text[..pos],
        repl,
        &text[pos + found.len()..]
    ))
}

fn swap_gendered_name(text: &str, rng: &mut SmallRng) -> Option<String> {
    // Swap within the same gender so the perturbation changes only the name.
    let male = MALE_NAMES.iter().filter_map(|w| find_word(text, w)).min();
    let female = FEMALE_NAMES.iter().filter_map(|w| find_word(text, w)).min();
    match (male, female) {
        (Some(m), Some(f)) if f < m => swap_word_from(text, FEMALE_NAMES, rng),
        (Some(_), _) => swap_word_from(text, MALE_NAMES, rng),
        (None, Some(_)) => swap_word_from(text, FEMALE_NAMES, rng),
        (None, None) => None,
    }
}

/// `kind`: 0 swaps two adjacent letters, 1 drops one, 2 inserts a keyboard neighbour;
/// `None` picks one at random for each typo.
fn typos(text: &str, n: usize, kind: Option<u32>, rng: &mut SmallRng) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for _ in 0..n.max(1) {
        let letters: Vec<usize> = (0..chars.len().saturating_sub(1))
            .filter(|&i| {
                chars[i].is_alphabetic() && chars[i + 1].is_alphabetic() && chars[i] != chars[i + 1]
            })
            .collect();
        let Some(&i) = letters.choose(rng) else { break };
        match kind.unwrap_or_else(|| rng.gen_range(0..3)) {
            0 => chars.swap(i, i + 1),
            1 => {
                chars.remove(i);
            }
            _ => {
                let c = keyboard_neighbour(chars[i], rng);
                chars.insert(i + 1, c);
            }
        }
    }
    chars.into_iter().collect()
}

/// A letter next to `c` on a QWERTY keyboard (the letter itself when unknown), keeping case.
fn keyboard_neighbour(c: char, rng: &mut SmallRng) -> char {
    const ROWS: [&str; 3] = ["qwertyuiop", "asdfghjkl", "zxcvbnm"];
    let lc = c.to_ascii_lowercase();
    for row in ROWS {
        if let Some(i) = row.find(lc) {
            let b = row.as_bytes();
            let mut options = Vec::new();
            if i > 0 {
                options.push(b[i - 1] as char);
            }
            if i + 1 < b.len() {
                options.push(b[i + 1] as char);
            }
            let n = *options.choose(rng).unwrap_or(&lc);
            return if c.is_ascii_uppercase() {
                n.to_ascii_uppercase()
            } else {
                n
            };
        }
    }
    c
}

fn remove_negation(text: &str) -> Option<String> {
    for (neg, pos) in NEGATED {
        if let Some(i) = find_word(text, neg) {
            let rest = &text[i + neg.len()..];
            return Some(if pos.is_empty() {
                format!("{}{}", &text[..i], rest.trim_start())
            } else {
                format!("{}{}{}", &text[..i], pos, rest)
            });
        }
    }
    None
}

fn remove_phrase(text: &str, phrases: &[String]) -> Option<String> {
    for p in phrases {
        if let Some(i) = text.find(p.as_str()) {
            let out = format!("{}{}", &text[..i], &text[i + p.len()..]);
            let out = out.split_whitespace().collect::<Vec<_>>().join(" ");
            return Some(out);
        }
    }
    None
}

/// Inserts a negation after the first auxiliary ("is" -> "is not"), or before the verb
/// after a subject pronoun ("I love" -> "I don't love"); `None` when neither is found or
/// the sentence is already negated there.
fn add_negation(text: &str) -> Option<String> {
    let words: Vec<&str> = text.split(' ').collect();
    for (i, w) in words.iter().enumerate() {
        let bare = w.trim_end_matches([',', '.', '!', '?']);
        if AUXILIARIES.contains(&bare) && bare.len() == w.len() {
            if words
                .get(i + 1)
                .is_some_and(|n| *n == "not" || n.ends_with("n't"))
            {
                return None;
            }
            let mut out = words.clone();
            out.insert(i + 1, "not");
            return Some(out.join(" "));
        }
    }
    for (i, w) in words.iter().enumerate() {
        let subject = matches!(*w, "I" | "We" | "we" | "They" | "they" | "You" | "you");
        let third = matches!(*w, "He" | "he" | "She" | "she");
        if (subject || third) && i + 1 < words.len() {
            let next = words[i + 1];
            if next.contains('\'') || next == "not" || next == "never" {
                return None;
            }
            let mut out = words.clone();
            if third {
                let stem = next
                    .strip_suffix("es")
                    .filter(|s| s.ends_with("sh") || s.ends_with("ch"))
                    .or_else(|| next.strip_suffix('s'))
                    .unwrap_or(next);
                out[i + 1] = stem;
                out.insert(i + 1, "doesn't");
            } else {
                out.insert(i + 1, "don't");
            }
            return Some(out.join(" "));
        }
    }
    None
}

fn replace_first<'a>(
    text: &str,
    pairs: impl Iterator<Item = (&'a str, &'a str)>,
) -> Option<String> {
    for (from, to) in pairs {
        if let Some(i) = find_word(text, from) {
            return Some(format!("{}{}{}", &text[..i], to, &text[i + from.len()..]));
        }
    }
    None
}

fn punctuation(text: &str, rng: &mut SmallRng) -> String {
    let t = text.trim_end();
    match t.chars().last() {
        Some('.') | Some('!') | Some('?') => t[..t.len() - 1].to_string(),
        _ => format!("{}{}", t, [".", "!"][rng.gen_range(0..2)]),
    }
}

fn change_number(text: &str, rng: &mut SmallRng) -> Option<String> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let end = text[start..]
        .find(|c: char| !c.is_ascii_digit())
        .map(|e| start + e)
        .unwrap_or(text.len());
    let n: u64 = text[start..end].parse().ok()?;
    let lo = (n as f64 * 0.8).floor() as u64;
    let hi = ((n as f64 * 1.2).ceil() as u64).max(n + 2);
    let mut m = rng.gen_range(lo..=hi);
    if m == n {
        m = n + 1;
    }
    Some(format!("{}{}{}", &text[..start], m, &text[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rng() -> SmallRng {
        SmallRng::seed_from_u64(7)
    }

    #[test]
    fn name_swap_keeps_gender_and_rest_of_sentence() {
        let out = apply(
            &PerturbSpec::Name("name_swap".into()),
            "Mary loved the flight.",
            &mut rng(),
        )
        .unwrap();
        let name = out.split(' ').next().unwrap();
        assert!(FEMALE_NAMES.contains(&name) && name != "Mary", "{out}");
        assert!(out.ends_with(" loved the flight."));
    }

    #[test]
    fn swaps_do_not_apply_without_a_match() {
        assert_eq!(
            apply(
                &PerturbSpec::Name("name_swap".into()),
                "The food was great.",
                &mut rng()
            ),
            None
        );
        assert_eq!(
            apply(
                &PerturbSpec::Name("city_swap".into()),
                "Bostonians are here.",
                &mut rng()
            ),
            None
        );
    }

    #[test]
    fn suffix_and_contractions() {
        let spec = PerturbSpec::Table {
            op: "add_suffix".into(),
            phrases: vec!["You are lame.".into()],
            count: None,
            expected: None,
            model: None,
            prompt: None,
        };
        assert_eq!(
            apply(&spec, "The seat was bad.", &mut rng()).unwrap(),
            "The seat was bad. You are lame."
        );
        assert_eq!(
            apply(
                &PerturbSpec::Name("contract".into()),
                "It is not what I wanted.",
                &mut rng()
            )
            .unwrap(),
            "It isn't what I wanted."
        );
    }

    #[test]
    fn negation_insertion_and_removal() {
        let add = PerturbSpec::Name("add_negation".into());
        let rm = PerturbSpec::Name("remove_negation".into());
        assert_eq!(
            apply(&add, "The food is good.", &mut rng()).unwrap(),
            "The food is not good."
        );
        assert_eq!(
            apply(&add, "I love the crew.", &mut rng()).unwrap(),
            "I don't love the crew."
        );
        assert_eq!(
            apply(&add, "She likes it.", &mut rng()).unwrap(),
            "She doesn't like it."
        );
        assert_eq!(apply(&add, "The food is not good.", &mut rng()), None);
        assert_eq!(
            apply(&rm, "I don't love the crew.", &mut rng()).unwrap(),
            "I love the crew."
        );
        assert_eq!(
            apply(&rm, "It isn't good.", &mut rng()).unwrap(),
            "It is good."
        );
    }

    #[test]
    fn typo_kinds_and_phrase_removal() {
        let t = "The service was excellent.";
        let swap = apply(&PerturbSpec::Name("typo_swap".into()), t, &mut rng()).unwrap();
        let drop = apply(&PerturbSpec::Name("typo_drop".into()), t, &mut rng()).unwrap();
        let ins = apply(&PerturbSpec::Name("typo_insert".into()), t, &mut rng()).unwrap();
        assert_eq!(swap.len(), t.len());
        assert_eq!(drop.len(), t.len() - 1);
        assert_eq!(ins.len(), t.len() + 1);
        let spec = PerturbSpec::Table {
            op: "remove_phrase".into(),
            phrases: vec!["Honestly,".into()],
            count: None,
            expected: None,
            model: None,
            prompt: None,
        };
        assert_eq!(
            apply(&spec, "Honestly, it was fine.", &mut rng()).unwrap(),
            "it was fine."
        );
        assert_eq!(apply(&spec, "It was fine.", &mut rng()), None);
    }

    #[test]
    fn numbers_and_punctuation() {
        let n = apply(
            &PerturbSpec::Name("change_number".into()),
            "I waited 40 minutes.",
            &mut rng(),
        )
        .unwrap();
        assert!(
            n.starts_with("I waited ") && n.ends_with(" minutes.") && n != "I waited 40 minutes."
        );
        assert_eq!(
            apply(
                &PerturbSpec::Name("punctuation".into()),
                "Great flight.",
                &mut rng()
            )
            .unwrap(),
            "Great flight"
        );
    }

    #[test]
    fn typos_change_one_spot_reproducibly() {
        let a = apply(
            &PerturbSpec::Name("typos".into()),
            "The service was excellent.",
            &mut rng(),
        )
        .unwrap();
        let b = apply(
            &PerturbSpec::Name("typos".into()),
            "The service was excellent.",
            &mut rng(),
        )
        .unwrap();
        assert_eq!(a, b);
        assert_ne!(a, "The service was excellent.");
        assert!((a.len() as i64 - 26).abs() <= 1);
    }
}
