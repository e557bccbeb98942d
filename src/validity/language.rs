//! The language of an answer, for the validity rule's `unscorable_language` and the cue
//! scorer: the script by character class, then function words, then whatlang's trigram
//! detector only where another language shows.

/// The language of an answer: `zh`, `ja` (any kana), `ko` (Hangul), `en`, `mixed`
/// (Chinese and English), another ISO 639-1 code, or `und`: no letters at all, or letters
/// whose language the text does not tell (a short text with signs of several languages).
///
/// Uses the CJK-vs-Latin ratio rule from six-checks-before-you-trust: r = cjk / (cjk +
/// latin); r > 0.35 is CJK (Japanese when any kana is present, Korean for Hangul, else
/// Chinese), r < 0.05 is Latin script, otherwise mixed. The script is decided by character
/// class in one pass. Latin-script text is English when its function words say so, or
/// when nothing says otherwise (a label such as `positive`); a text with a sign of another
/// language is read by the (slow) trigram detector when long enough for it, and by a vote
/// of the function words of the common Latin-script languages when short
/// ([`short_text_language`]): whatlang is unreliable below a sentence or two and called
/// short Spanish answers English (whatlang costs about 100 µs a text, the rest 1 µs).
pub fn language(text: &str) -> String {
    let (mut han, mut kana, mut hangul, mut latin, mut other_letters) =
        (0usize, 0usize, 0usize, 0usize, false);
    if text.is_ascii() {
        // Most answers: a byte loop, no UTF-8 decoding.
        latin = text.bytes().filter(u8::is_ascii_alphabetic).count();
    } else {
        for c in text.chars() {
            if c.is_ascii_alphabetic() {
                latin += 1;
            } else if ('\u{4e00}'..='\u{9fff}').contains(&c) {
                han += 1;
            } else if ('\u{3040}'..='\u{30ff}').contains(&c)
                || ('\u{ff66}'..='\u{ff9f}').contains(&c)
            {
                kana += 1;
            } else if ('\u{ac00}'..='\u{d7af}').contains(&c)
                || ('\u{1100}'..='\u{11ff}').contains(&c)
            {
                hangul += 1;
            } else if !c.is_ascii() && c.is_alphabetic() {
                if c.is_alphabetic() && (c as u32) < 0x0250 {
                    // Accented Latin letters (é, ñ, ß, ł, ...) are Latin script.
                    latin += 1;
                } else {
                    other_letters = true;
                }
            }
        }
    }
    let cjk = han + kana + hangul;
    if cjk + latin == 0 {
        // Other scripts (Cyrillic, Arabic, ...) or no letters at all.
        if !other_letters {
            return "und".into();
        }
        return match whatlang::detect(text) {
            Some(info) if info.is_reliable() => iso639_1(info.lang()).to_string(),
            _ => "other".into(),
        };
    }
    let r = cjk as f64 / (cjk + latin) as f64;
    // Kana is written only in Japanese (whose kanji are Han): any kana makes CJK text
    // Japanese, even beside English words; Hangul is Korean.
    if r >= 0.05 && kana > 0 {
        return "ja".into();
    }
    if r >= 0.05 && hangul > han {
        return "ko".into();
    }
    if r > 0.35 {
        return "zh".into();
    }
    if r >= 0.05 {
        return "mixed".into();
    }
    if reads_as_english(text) {
        return "en".into();
    }
    if latin >= 40 {
        if !other_language_signs(text) {
            return "en".into();
        }
        // The detector reads the first 1,000 bytes: enough for a language, and its cost
        // grows with the text.
        let head = &text[..text.floor_char_boundary(1000)];
        if let Some(info) = whatlang::detect(head)
            && info.is_reliable()
        {
            return iso639_1(info.lang()).to_string();
        }
    }
    // Short (or undecided) text: its words vote, and no evidence leaves it English.
    short_text_language(text).to_string()
}

/// Function words (weight 1) and words only one language writes (weight 2) of the
/// Latin-script languages short answers most often come in, without words that are also
/// common in English (`no`, `die`, `son`, `as`, `do`, `man`, ...): a short answer's vote.
const SHORT_WORDS: &[(&str, &[&str], &[&str])] = &[
    (
        "es",
        &[
            "el", "la", "los", "las", "del", "que", "y", "en", "un", "una", "es", "por", "para",
            "pero", "muy", "lo", "se", "al", "como", "su", "fue", "hay", "bien", "esta", "este",
            "eso", "todo", "nada", "mucho", "ser", "sin", "mi", "yo", "bueno", "buena", "claro",
            "correcto", "cierto", "verdad", "sobre",
        ],
        &[
            "sí",
            "está",
            "están",
            "qué",
            "sé",
            "también",
            "gracias",
            "usted",
            "más",
            "así",
            "cómo",
            "dónde",
            "porque",
            "acuerdo",
            "respuesta",
            "hola",
            "señor",
            "año",
            "años",
            "ningún",
            "ninguna",
            "ahora",
            "depende",
        ],
    ),
    (
        "pt",
        &[
            "os", "da", "das", "dos", "em", "um", "uma", "que", "se", "com", "para", "por", "foi",
            "mais", "muito", "bem", "isso", "sim", "ele", "ela", "mas",
        ],
        &[
            "não", "são", "está", "obrigado", "obrigada", "você", "também", "então", "olá",
        ],
    ),
    (
        "fr",
        &[
            "le", "la", "les", "des", "du", "de", "et", "est", "une", "un", "pas", "qui", "dans",
            "sur", "avec", "ce", "il", "elle", "nous", "vous", "je", "mais", "ou", "au", "aux",
            "ne", "bien", "oui", "tout", "cette", "sont",
        ],
        &[
            "très", "merci", "bonjour", "être", "à", "où", "ça", "déjà", "voilà", "réponse",
        ],
    ),
    (
        "de",
        &[
            "der", "das", "und", "ist", "nicht", "ein", "eine", "mit", "sich", "auf", "dem", "zu",
            "von", "sehr", "auch", "aber", "ich", "sie", "wir", "nein", "es", "ja", "gut", "den",
        ],
        &[
            "danke",
            "bitte",
            "für",
            "über",
            "können",
            "natürlich",
            "genau",
            "richtig",
        ],
    ),
    (
        "it",
        &[
            "il", "lo", "gli", "di", "che", "non", "per", "sono", "della", "molto", "ma", "anche",
            "bene", "con", "questo", "questa", "come", "un", "una",
        ],
        &[
            "grazie", "ciao", "perché", "sì", "è", "più", "così", "risposta", "certo",
        ],
    ),
    (
        "nl",
        &[
            "het", "een", "van", "niet", "zijn", "maar", "ook", "de", "en", "dat", "ik", "je",
        ],
        &["nee", "goed", "dank", "bedankt", "alsjeblieft", "wel"],
    ),
];

/// The language of a short Latin-script text with a sign of another language than English:
/// the language whose words ([`SHORT_WORDS`]) weigh at least 2 and more than any other
/// language's and the English function words'; `und` when two or more languages tie
/// there (evidence, but not of one language); `en` when the evidence is a single weak
/// word (a name such as "Charles de Gaulle" in an English answer).
fn short_text_language(text: &str) -> &'static str {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<&'static str, Vec<(usize, u32)>>> =
        std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t: std::collections::HashMap<&'static str, Vec<(usize, u32)>> = Default::default();
        for (i, (_, weak, strong)) in SHORT_WORDS.iter().enumerate() {
            for w in *weak {
                t.entry(*w).or_default().push((i, 1));
            }
            for w in *strong {
                t.entry(*w).or_default().push((i, 2));
            }
        }
        t
    });
    let mut votes = [0u32; SHORT_WORDS.len()];
    // Each word once ("La La Land" is one `la`); ASCII words are lowered without allocating
    // (most short answers are labels that match nothing).
    let mut seen: Vec<&'static str> = Vec::new();
    let mut buf = [0u8; 16];
    for w in text
        .split(|c: char| !c.is_alphabetic())
        .filter(|w| !w.is_empty())
    {
        let owned;
        let lower: &str = if w.is_ascii() && w.len() <= buf.len() {
            let b = &mut buf[..w.len()];
            b.copy_from_slice(w.as_bytes());
            b.make_ascii_lowercase();
            std::str::from_utf8(b).unwrap_or_default()
        } else {
            owned = w.to_lowercase();
            &owned
        };
        if let Some((key, hits)) = table.get_key_value(lower)
            && !seen.contains(key)
        {
            seen.push(key);
            for (i, weight) in hits {
                votes[*i] += weight;
            }
        }
    }
    let english = english_hits(text).0 as u32;
    let best = *votes.iter().max().unwrap_or(&0);
    if best < 2 {
        return "en";
    }
    let leaders: Vec<usize> = (0..votes.len()).filter(|i| votes[*i] == best).collect();
    if leaders.len() == 1 && best > english {
        SHORT_WORDS[leaders[0]].0
    } else {
        "und"
    }
}

/// Whether at least a tenth of the words (and at least two) are English function words
/// that no other common Latin-script language uses as words (`the`, `and`, `with`, ...;
/// not `a`, `in`, `to`, `is`, `on`, `will`, `or`, `her`, which are also Spanish, German,
/// Polish, Dutch or French words). English prose has about a quarter of its words in
/// this list; text in another language has almost none.
fn reads_as_english(text: &str) -> bool {
    let (hits, words) = english_hits(text);
    hits >= 2 && hits * 10 >= words
}

/// (English function words of [`reads_as_english`], words) of `text`.
fn english_hits(text: &str) -> (usize, usize) {
    let (mut words, mut hits) = (0usize, 0usize);
    let mut buf = [0u8; 6];
    for w in text
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| !w.is_empty())
    {
        words += 1;
        if w.len() < 2 || w.len() > buf.len() {
            continue;
        }
        let lower = &mut buf[..w.len()];
        lower.copy_from_slice(w.as_bytes());
        lower.make_ascii_lowercase();
        if matches!(
            &*lower,
            b"the"
                | b"and"
                | b"of"
                | b"that"
                | b"this"
                | b"with"
                | b"for"
                | b"you"
                | b"your"
                | b"are"
                | b"not"
                | b"have"
                | b"has"
                | b"had"
                | b"be"
                | b"been"
                | b"were"
                | b"would"
                | b"can"
                | b"could"
                | b"should"
                | b"it"
                | b"its"
                | b"they"
                | b"them"
                | b"their"
                | b"there"
                | b"what"
                | b"which"
                | b"who"
                | b"when"
                | b"where"
                | b"how"
                | b"from"
                | b"but"
                | b"if"
                | b"we"
                | b"our"
                | b"she"
                | b"his"
                | b"than"
                | b"these"
                | b"those"
                | b"about"
                | b"into"
                | b"more"
                | b"some"
                | b"any"
                | b"at"
        ) {
            hits += 1;
        }
    }
    (hits, words)
}

/// Whether Latin-script text shows a sign of a language other than English: a non-ASCII
/// letter (accents, ß, ł, ı, ...) or a frequent function word of another Latin-script
/// language that is not also a common English word. Real text in those languages has
/// several in any 40 letters; a false sign only costs a detector call.
fn other_language_signs(text: &str) -> bool {
    if !text.is_ascii() && text.chars().any(|c| !c.is_ascii() && c.is_alphabetic()) {
        return true;
    }
    static WORDS: std::sync::OnceLock<std::collections::HashSet<&'static [u8]>> =
        std::sync::OnceLock::new();
    let words = WORDS.get_or_init(|| FOREIGN_WORDS.iter().copied().collect());
    let mut buf = [0u8; 7];
    text.split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| !w.is_empty() && w.len() <= 7)
        .any(|w| {
            let lower = &mut buf[..w.len()];
            lower.copy_from_slice(w.as_bytes());
            lower.make_ascii_lowercase();
            words.contains(&*lower)
        })
}

/// Function words of Spanish, French, German, Italian, Portuguese, Dutch, the Nordic
/// languages, Polish, Czech, Romanian, Turkish, Indonesian and Malay, Tagalog, Swahili,
/// Finnish, Hungarian and Vietnamese (without accents), minus common English words.
const FOREIGN_WORDS: &[&[u8]] = &[
    b"de", b"la", b"el", b"los", b"las", b"del", b"y", b"que", b"en", b"un", b"una", b"es", b"por",
    b"para", b"con", b"pero", b"muy", b"lo", b"se", b"al", b"mas", b"como", b"su", b"le", b"les",
    b"des", b"et", b"est", b"du", b"une", b"pas", b"qui", b"dans", b"sur", b"avec", b"ce", b"il",
    b"elle", b"nous", b"vous", b"je", b"tres", b"der", b"die", b"das", b"und", b"ist", b"nicht",
    b"ein", b"eine", b"mit", b"sich", b"auf", b"den", b"dem", b"zu", b"von", b"sehr", b"auch",
    b"aber", b"ich", b"sie", b"wir", b"het", b"een", b"van", b"niet", b"zijn", b"maar", b"ook",
    b"di", b"che", b"non", b"per", b"sono", b"della", b"molto", b"gli", b"e", b"o", b"da", b"dos",
    b"em", b"os", b"uma", b"nao", b"mais", b"ele", b"och", b"att", b"det", b"som", b"inte", b"jag",
    b"og", b"ikke", b"jeg", b"til", b"af", b"ve", b"bir", b"bu", b"ile", b"icin", b"cok", b"yang",
    b"dan", b"ini", b"itu", b"untuk", b"dengan", b"tidak", b"adalah", b"dari", b"ke", b"ang",
    b"ng", b"mga", b"sa", b"ay", b"na", b"ni", b"kwa", b"ya", b"wa", b"za", b"sana", b"si", b"cu",
    b"pe", b"mai", b"sau", b"ze", b"jako", b"nie", b"jest", b"ale", b"bardzo", b"bylo", b"dla",
    b"ja", b"ei", b"ole", b"hogy", b"nem", b"az", b"egy", b"va", b"cua", b"khong", b"nhung",
    b"rat",
];

fn iso639_1(l: whatlang::Lang) -> &'static str {
    use whatlang::Lang::*;
    match l {
        Eng => "en",
        Cmn => "zh",
        Spa => "es",
        Fra => "fr",
        Deu => "de",
        Ita => "it",
        Por => "pt",
        Rus => "ru",
        Jpn => "ja",
        Kor => "ko",
        Ara => "ar",
        Hin => "hi",
        Nld => "nl",
        Tur => "tr",
        Pol => "pl",
        Swe => "sv",
        Ukr => "uk",
        Vie => "vi",
        Ind => "id",
        Tgl => "tl",
        Ron => "ro",
        Ces => "cs",
        Hun => "hu",
        Fin => "fi",
        Dan => "da",
        _ => l.code(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validity::{CallView, decide};

    fn en() -> Vec<String> {
        vec!["en".into()]
    }

    #[test]
    fn language_rule_from_the_seed() {
        assert_eq!(language("The food was great."), "en");
        assert_eq!(
            language("之前推荐的一些品牌基本都超了，不建议强行上付费版"),
            "zh"
        );
        assert_eq!(language("Asana 和 Monday.com 的付费版都超了预算"), "zh");
        assert_eq!(
            language("Premium tiers of Asana and Monday are over budget 不建议"),
            "mixed"
        );
        assert_eq!(language("12345"), "und");
    }

    /// The detector runs only where another language shows: an English word list it would
    /// call French stays English, and text in another language without a single accent is
    /// still detected by its function words.
    #[test]
    fn detector_only_for_signs_of_another_language() {
        let words = "Neutral. Large about cold our our breakfast hot large coffee soft";
        assert!(!other_language_signs(words));
        assert_eq!(language(words), "en");
        let es = "la comida estaba muy buena pero el servicio fue lento y caro no lo recomiendo";
        assert!(other_language_signs(es));
        assert_eq!(language(es), "es");
        let tl = "Masarap ang pagkain at mabilis ang serbisyo dito sa restawran";
        assert!(other_language_signs(tl));
        assert_eq!(language(tl), "tl");
        assert!(other_language_signs(
            "Das Essen war gut, aber teuer und langsam serviert"
        ));
        assert!(other_language_signs("Le repas était bon"));
    }

    /// Short answers in another language are not English on no evidence; kana is
    /// Japanese; labels and English with a foreign name stay English.
    #[test]
    fn short_answers_and_japanese_get_their_own_language() {
        assert_eq!(language("Sí, es correcto."), "es");
        assert_eq!(language("No, gracias."), "es");
        assert_eq!(language("Muy bien"), "es");
        assert_eq!(language("La respuesta es sí"), "es");
        assert_eq!(language("Das ist nicht richtig"), "de");
        assert_eq!(language("Oui, c'est très bien"), "fr");
        assert_eq!(language("Não, obrigado"), "pt");
        assert_eq!(language("Grazie, è corretto"), "it");
        // Words of two languages in equal measure: undetermined, not English.
        assert_eq!(language("de la"), "fr");
        assert_eq!(language("la et que"), "und");
        for en in [
            "positive",
            "Neutral.",
            "Yes",
            "I think so",
            "Charles de Gaulle",
            "La La Land",
            "The patient will die",
            "The Spanish for thank you is gracias",
        ] {
            assert_eq!(language(en), "en", "{en}");
        }
        assert_eq!(language("東京は日本の首都です。"), "ja");
        assert_eq!(language("ありがとうございます"), "ja");
        assert_eq!(language("Asana は良いツールです"), "ja");
        assert_eq!(language("서울은 한국의 수도입니다"), "ko");
        assert_eq!(language("东京是日本的首都。"), "zh");
        // An undetermined text with letters is not scored as English; a number still is.
        let und = CallView {
            response: Some("la et que"),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        let v = decide(&und, &en());
        assert_eq!(
            (v.validity, v.language.as_str()),
            ("unscorable_language", "und")
        );
        assert_eq!(
            decide(&und, &["en".into(), "und".into()]).validity,
            "valid_answer"
        );
        let es = CallView {
            response: Some("Sí, es correcto."),
            finish_reason: Some("stop"),
            ..Default::default()
        };
        assert_eq!(decide(&es, &en()).validity, "unscorable_language");
    }
}
