//! Generate: expands a CheckList suite (templates x lexicons, or an unlabelled dataset,
//! then perturbations) into the `cases` table.
//!
//! Every case gets a stable content-hash `case_id`, a `template_id` (the cluster for
//! clustered standard errors) and a `group_id` tying each perturbed case to its base, so
//! no later stage needs bookkeeping. Expansion is deterministic for a given suite seed.
//!
//! # Streaming
//! Cases are produced in batches by [`CaseStream`]: a template is never materialised. A
//! template that fits its test's budget is enumerated in mixed-radix order; a larger one is
//! sampled by walking a seeded pseudo-random permutation of its index space (a Feistel
//! network), so memory stays constant whatever the case count. Texts that an earlier,
//! fully expanded template of the same test already produced are skipped by matching the
//! text against that template, not by remembering what was emitted.

pub mod perturb;
pub mod rephrase;
pub mod source;
pub mod suggest;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use sha2::{Digest, Sha256};

use crate::pipeline::{ModelConfig, PerturbSpec, Pipeline, PipelineError, TestConfig};
use crate::schema::Table;
pub use crate::schema::{Case, cases_batch as to_batch};
use crate::stages::call::{CallError, Provider};
use crate::storage::{RunStore, StorageError};

/// Errors of the generate stage.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The suite is wrong (names the file, line and field).
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// The `rephrase` model cannot be built.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The nested rephrase run could not be written.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The `rephrase` model failed on a case.
    #[error("test `{test}`: rephrase of \"{input}\" failed: {msg}")]
    Rephrase {
        test: String,
        input: String,
        msg: String,
    },
}

/// A stable id from the parts that define a case's content.
pub fn content_hash(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    hex::encode(h.finalize())[..20].to_string()
}

fn hash_u64(parts: &[&str]) -> u64 {
    u64::from_str_radix(&content_hash(parts)[..16], 16).expect("hex")
}

/// How a slot renders its word: as is, or after "a"/"an" (`{a:x}`), or "A"/"An" (`{A:x}`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Article {
    None,
    Lower,
    Upper,
}

#[derive(Debug, Clone)]
enum Piece {
    Text(String),
    Slot(usize, Article),
}

/// A parsed template: literal pieces and slots, each slot drawing from a word list.
/// `{thing}` twice is one slot (the same word twice); `{thing2}` is a second, independent
/// slot over the `thing` lexicon (unless a lexicon is literally called `thing2`).
#[derive(Debug, Clone)]
pub struct Template {
    pieces: Vec<Piece>,
    slots: Vec<Vec<String>>,
    expected: Option<String>,
}

fn with_article(word: &str, article: Article) -> String {
    let lower = word.to_lowercase();
    let first = lower.chars().next();
    let acronym = word.len() > 1 && word.chars().all(|c| c.is_ascii_uppercase());
    let an = if acronym {
        "AEFHILMNORSX".contains(word.chars().next().unwrap_or('B'))
    } else if ["uni", "use", "usu", "uti", "eu", "one", "once", "ewe"]
        .iter()
        .any(|p| lower.starts_with(p))
    {
        false
    } else if ["hour", "honest", "honor", "honour", "heir"]
        .iter()
        .any(|p| lower.starts_with(p))
    {
        true
    } else {
        matches!(first, Some('a' | 'e' | 'i' | 'o' | 'u'))
    };
    let art = match (article, an) {
        (Article::Upper, true) => "An",
        (Article::Upper, false) => "A",
        (_, true) => "an",
        (_, false) => "a",
    };
    format!("{art} {word}")
}

impl Template {
    /// Parses `text`, resolving placeholders against `lexicons`.
    ///
    /// # Errors
    /// Unclosed braces and unknown placeholders, naming the file and line of the template.
    fn parse(
        p: &Pipeline,
        test: &TestConfig,
        text: &str,
        expected: Option<String>,
        lexicons: &BTreeMap<String, Vec<String>>,
    ) -> Result<Template, PipelineError> {
        let field = format!("test `{}` templates", test.name);
        let mut pieces = Vec::new();
        let mut keys: Vec<String> = Vec::new();
        let mut slots: Vec<Vec<String>> = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                pieces.push(Piece::Text(rest[..open].to_string()));
            }
            let close = rest[open..].find('}').ok_or_else(|| {
                p.invalid(
                    text,
                    &field,
                    format!("unclosed `{{` in template \"{text}\""),
                )
            })? + open;
            let inner = &rest[open + 1..close];
            let (article, key) = if let Some(k) = inner.strip_prefix("a:") {
                (Article::Lower, k)
            } else if let Some(k) = inner.strip_prefix("A:") {
                (Article::Upper, k)
            } else {
                (Article::None, inner)
            };
            let lexicon = if lexicons.contains_key(key) {
                key.to_string()
            } else {
                key.trim_end_matches(|c: char| c.is_ascii_digit())
                    .to_string()
            };
            let words = lexicons.get(&lexicon).ok_or_else(|| {
                p.invalid(
                    text,
                    &field,
                    format!(
                        "unknown placeholder `{{{inner}}}` in template \"{text}\": no lexicon `{lexicon}` \
                         (define it under [lexicons] or in a `[suite] include` file; built in: {})",
                        perturb::BUILTIN_LEXICONS.join(", ")
                    ),
                )
            })?;
            let idx = match keys.iter().position(|k| k == key) {
                Some(i) => i,
                None => {
                    keys.push(key.to_string());
                    slots.push(words.clone());
                    slots.len() - 1
                }
            };
            pieces.push(Piece::Slot(idx, article));
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_string()));
        }
        Ok(Template {
            pieces,
            slots,
            expected,
        })
    }

    /// The number of texts the template expands to (cartesian product of its slots).
    pub fn size(&self) -> u128 {
        self.slots.iter().map(|w| w.len() as u128).product()
    }

    /// The `i`-th combination in mixed-radix order (last slot fastest).
    fn fill(&self, mut i: u64) -> String {
        let mut choice = vec![0usize; self.slots.len()];
        for (s, words) in self.slots.iter().enumerate().rev() {
            let n = words.len() as u64;
            choice[s] = (i % n) as usize;
            i /= n;
        }
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Slot(s, Article::None) => out.push_str(&self.slots[*s][choice[*s]]),
                Piece::Slot(s, a) => out.push_str(&with_article(&self.slots[*s][choice[*s]], *a)),
            }
        }
        out
    }

    /// Whether `text` is one of this template's expansions.
    fn matches(&self, text: &str) -> bool {
        let mut bound = vec![None; self.slots.len()];
        self.match_from(0, text, &mut bound)
    }

    fn match_from(&self, pi: usize, s: &str, bound: &mut Vec<Option<usize>>) -> bool {
        let Some(piece) = self.pieces.get(pi) else {
            return s.is_empty();
        };
        match piece {
            Piece::Text(t) => {
                s.starts_with(t.as_str()) && self.match_from(pi + 1, &s[t.len()..], bound)
            }
            Piece::Slot(slot, art) => {
                let render = |w: &str| match art {
                    Article::None => w.to_string(),
                    a => with_article(w, *a),
                };
                if let Some(w) = bound[*slot] {
                    let r = render(&self.slots[*slot][w]);
                    return s.starts_with(&r) && self.match_from(pi + 1, &s[r.len()..], bound);
                }
                for w in 0..self.slots[*slot].len() {
                    let r = render(&self.slots[*slot][w]);
                    if s.starts_with(&r) {
                        bound[*slot] = Some(w);
                        if self.match_from(pi + 1, &s[r.len()..], bound) {
                            return true;
                        }
                        bound[*slot] = None;
                    }
                }
                false
            }
        }
    }
}

/// A seeded permutation of `0..n` (a balanced Feistel network with cycle walking), so a
/// template can be sampled without replacement in constant memory.
#[derive(Debug, Clone)]
struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Permutation {
    fn new(n: u64, seed: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let k0 = splitmix(seed);
        let keys = [k0, splitmix(k0), splitmix(k0 ^ 1), splitmix(k0 ^ 2)];
        Self { n, half_bits, keys }
    }

    fn round(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for k in self.keys {
            let f = splitmix(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    fn get(&self, i: u64) -> u64 {
        let mut x = i;
        loop {
            x = self.round(x);
            if x < self.n {
                return x;
            }
        }
    }
}

/// Water-filling: splits `budget` evenly across lists of the given sizes (unused quota of
/// small lists goes to larger ones), so a one-sentence template (a literal case such as
/// "The food is not poor.") is always kept.
fn allocate(sizes: &[u128], budget: u128) -> Vec<u128> {
    let total: u128 = sizes.iter().sum();
    if total <= budget {
        return sizes.to_vec();
    }
    let mut quota = vec![0u128; sizes.len()];
    let mut left = budget;
    while left > 0 {
        let open: Vec<usize> = (0..sizes.len()).filter(|&i| quota[i] < sizes[i]).collect();
        if open.is_empty() {
            break;
        }
        let share = (left / open.len() as u128).max(1);
        for i in open {
            if left == 0 {
                break;
            }
            let add = share.min(sizes[i] - quota[i]).min(left);
            quota[i] += add;
            left -= add;
        }
    }
    quota
}

/// A checked test, ready to stream.
struct TestPlan {
    idx: usize,
    templates: Vec<Template>,
    quotas: Vec<u64>,
    perms: Vec<Option<Permutation>>,
    tolerance: Option<f64>,
    budget: u64,
}

/// Which model answers `rephrase` for a spec: `[rephrase]`, `[judge]` or `[model]`.
pub fn rephrase_model<'a>(p: &'a Pipeline, spec: &PerturbSpec) -> Option<&'a ModelConfig> {
    rephrase_table(p, spec).map(|(_, m)| m)
}

/// [`rephrase_model`] with the name of its table (`rephrase`, `judge` or `model`).
pub fn rephrase_table<'a>(
    p: &'a Pipeline,
    spec: &PerturbSpec,
) -> Option<(&'static str, &'a ModelConfig)> {
    let which = match spec {
        PerturbSpec::Table { model: Some(m), .. } => m.as_str(),
        _ => "",
    };
    let rephrase = p.rephrase.as_ref().map(|m| ("rephrase", m));
    let judge = p.judge.as_ref().map(|m| ("judge", m));
    match which {
        "rephrase" => rephrase,
        "judge" => judge,
        "model" => Some(("model", &p.model)),
        _ => rephrase.or(judge).or(Some(("model", &p.model))),
    }
}

/// The model used for `rephrase` in this pipeline, when any test uses it (the first, when
/// tests name different ones: [`rephrase_models`] lists them all).
pub fn rephrase_model_for(p: &Pipeline) -> Option<&ModelConfig> {
    rephrase_models(p).into_iter().next().map(|(_, m)| m)
}

/// Every model a `rephrase` test of this pipeline uses, each once with its table's name, in
/// test order.
pub fn rephrase_models(p: &Pipeline) -> Vec<(&'static str, &ModelConfig)> {
    let mut out: Vec<(&'static str, &ModelConfig)> = Vec::new();
    let specs = p.tests.iter().filter_map(|t| t.perturb.as_ref());
    for (table, m) in specs
        .filter(|s| s.op() == "rephrase")
        .filter_map(|s| rephrase_table(p, s))
    {
        if !out.iter().any(|(t, _)| *t == table) {
            out.push((table, m));
        }
    }
    out
}

fn lexicons_of(p: &Pipeline) -> BTreeMap<String, Vec<String>> {
    let mut lexicons: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for name in perturb::BUILTIN_LEXICONS {
        lexicons.insert(name.to_string(), perturb::builtin_lexicon(name).unwrap());
    }
    for (k, words) in &p.lexicons {
        // A repeated word would repeat texts; keep its first occurrence.
        let mut seen = std::collections::HashSet::new();
        let uniq = words.iter().filter(|w| seen.insert(*w)).cloned().collect();
        lexicons.insert(k.clone(), uniq);
    }
    lexicons
}

fn plan_test(
    p: &Pipeline,
    idx: usize,
    lexicons: &BTreeMap<String, Vec<String>>,
) -> Result<TestPlan, PipelineError> {
    let test = &p.tests[idx];
    let needle = format!("\"{}\"", test.name);
    if let Some(spec) = &test.perturb {
        if !perturb::OPERATORS.contains(&spec.op()) {
            return Err(p.invalid(
                &format!("\"{}\"", spec.op()),
                "test.perturb",
                format!(
                    "test `{}`: unknown perturbation `{}` (known: {})",
                    test.name,
                    spec.op(),
                    perturb::OPERATORS.join(", ")
                ),
            ));
        }
        let phrases = match spec {
            PerturbSpec::Table { phrases, .. } => phrases.len(),
            PerturbSpec::Name(_) => 0,
        };
        if perturb::NEEDS_PHRASES.contains(&spec.op()) && phrases == 0 {
            return Err(p.invalid(
                &needle,
                "test.perturb.phrases",
                format!(
                    "test `{}`: `{}` needs `phrases = [...]`: perturb = {{ op = \"{}\", phrases = [\"...\"] }}",
                    test.name,
                    spec.op(),
                    spec.op()
                ),
            ));
        }
        if spec.op() == "rephrase" {
            match rephrase_model(p, spec) {
                Some(m) if m.provider.starts_with("builtin:") => {
                    return Err(p.invalid(
                        &needle,
                        "test.perturb.model",
                        format!(
                            "test `{}`: `rephrase` needs a generative model, but `{}` is a classifier: \
                             add a [rephrase] table (same keys as [model])",
                            test.name, m.provider
                        ),
                    ));
                }
                None => {
                    return Err(p.invalid(
                        &needle,
                        "test.perturb.model",
                        format!(
                            "test `{}`: the named rephrase model is not defined",
                            test.name
                        ),
                    ));
                }
                _ => {}
            }
        }
    }
    if let Some(src) = &test.source {
        let path = p.resolve(&src.file);
        if !path.is_file() {
            return Err(p.invalid(
                &format!("\"{}\"", src.file),
                "test.source.file",
                format!("test `{}`: no such file `{}`", test.name, path.display()),
            ));
        }
        source::Format::of(src).map_err(|msg| p.invalid(&needle, "test.source.format", msg))?;
    }
    let budget = test.max_cases.unwrap_or(p.suite.max_cases_per_test) as u64;
    let mut templates = Vec::new();
    for spec in &test.templates {
        let text = spec.text();
        let expected = spec
            .expected()
            .map(String::from)
            .or_else(|| test.expected.clone());
        let tpl = Template::parse(p, test, text, expected, lexicons)?;
        let size = tpl.size();
        if size > p.suite.max_expansion as u128 {
            return Err(p.invalid(
                text,
                &format!("test `{}` templates", test.name),
                format!(
                    "template \"{text}\" expands to {size} cases, above suite.max_expansion = {} \
                     (raise it, or split the lexicons)",
                    p.suite.max_expansion
                ),
            ));
        }
        templates.push(tpl);
    }
    let sizes: Vec<u128> = templates.iter().map(Template::size).collect();
    let quotas: Vec<u64> = allocate(&sizes, budget as u128)
        .into_iter()
        .map(|q| q as u64)
        .collect();
    let test_seed = p.suite.seed ^ hash_u64(&[&p.suite.name, &test.name]);
    let perms = sizes
        .iter()
        .zip(&quotas)
        .enumerate()
        .map(|(ti, (&n, &q))| {
            (u128::from(q) < n).then(|| Permutation::new(n as u64, test_seed ^ splitmix(ti as u64)))
        })
        .collect();
    let tolerance = match test.test_type.as_str() {
        "MFT" => None,
        _ => Some(test.tolerance.unwrap_or(p.score.tolerance)),
    };
    Ok(TestPlan {
        idx,
        templates,
        quotas,
        perms,
        tolerance,
        budget,
    })
}

/// A base case before perturbation.
struct Base {
    template_id: String,
    text: String,
    expected: Option<String>,
}

enum Cursor {
    Templates {
        t: usize,
        k: u64,
    },
    Source {
        reader: source::TextReader,
        taken: u64,
    },
}

/// The next base case of a test, from `cursor` (started at the test's first base when
/// `None`); a pure function of the suite, so the rephrase requests and the cases that use
/// their replies walk the same bases.
fn next_base(
    p: &Pipeline,
    plan: &TestPlan,
    cursor: &mut Option<Cursor>,
) -> Result<Option<Base>, GenerateError> {
    let test = &p.tests[plan.idx];
    if cursor.is_none() {
        *cursor = Some(match &test.source {
            Some(src) => Cursor::Source {
                reader: source::TextReader::open(&p.resolve(&src.file), src)?,
                taken: 0,
            },
            None => Cursor::Templates { t: 0, k: 0 },
        });
    }
    match cursor.as_mut().expect("set above") {
        Cursor::Templates { t, k } => loop {
            if *t >= plan.templates.len() {
                return Ok(None);
            }
            if *k >= plan.quotas[*t] {
                *t += 1;
                *k = 0;
                continue;
            }
            let tpl = &plan.templates[*t];
            let i = match &plan.perms[*t] {
                Some(perm) => perm.get(*k),
                None => *k,
            };
            *k += 1;
            let text = tpl.fill(i);
            // An earlier template that was expanded in full already produced it.
            let dup = (0..*t).any(|e| plan.perms[e].is_none() && plan.templates[e].matches(&text));
            if dup {
                continue;
            }
            return Ok(Some(Base {
                template_id: format!("{}/{}/t{}", p.suite.name, test.name, t),
                text,
                expected: tpl.expected.clone(),
            }));
        },
        Cursor::Source { reader, taken } => {
            if *taken >= plan.budget {
                return Ok(None);
            }
            let Some((row, text)) = reader.next()? else {
                return Ok(None);
            };
            *taken += 1;
            Ok(Some(Base {
                template_id: format!("{}/{}/row{}", p.suite.name, test.name, row),
                text,
                expected: None,
            }))
        }
    }
}

/// Streams a suite's cases in batches; memory does not grow with the number of cases.
///
/// # Example
/// ```no_run
/// # async fn f(p: &evalflow::pipeline::Pipeline) -> Result<(), evalflow::stages::generate::GenerateError> {
/// let mut s = evalflow::stages::generate::CaseStream::new(p)?;
/// while let Some(batch) = s.next_batch(8192).await? {
///     println!("{} cases", batch.len());
/// }
/// # Ok(()) }
/// ```
pub struct CaseStream<'a> {
    p: &'a Pipeline,
    plans: Vec<TestPlan>,
    current: usize,
    cursor: Option<Cursor>,
    cases_in_test: u64,
    rephraser: Option<Arc<dyn Provider>>,
    /// Providers of particular rephrase models (by their table's name), before `rephraser`.
    rephrasers: Vec<(&'static str, Arc<dyn Provider>)>,
    /// The run root whose `rephrase/` records the rephrase calls.
    root: Option<RunStore>,
    /// `--batch`: the rephrase calls go through the batch interface.
    batch: bool,
    /// By plan: the nested run of a rephrase test, once its requests were answered.
    groups: Option<Vec<Option<rephrase::Group>>>,
    /// The replies of the rephrase test being streamed: its plan and its replies.
    replies: Option<(usize, HashMap<String, Vec<rephrase::Reply>>)>,
}

impl<'a> CaseStream<'a> {
    /// Checks every test (placeholders, sizes, perturbations, sources) before any case is
    /// produced, so a bad suite fails fast.
    ///
    /// # Errors
    /// [`GenerateError::Pipeline`] naming the file, line and field of the first problem.
    pub fn new(p: &'a Pipeline) -> Result<Self, GenerateError> {
        let lexicons = lexicons_of(p);
        let plans = (0..p.tests.len())
            .map(|i| plan_test(p, i, &lexicons))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            p,
            plans,
            current: 0,
            cursor: None,
            cases_in_test: 0,
            rephraser: None,
            rephrasers: Vec::new(),
            root: None,
            batch: false,
            groups: None,
            replies: None,
        })
    }

    /// Sets the model that answers `rephrase` perturbations (built by the caller from
    /// [`rephrase_model_for`] with `call::build_provider`, or any [`Provider`]) and the run
    /// root whose `rephrase/` nested runs record its calls (so a re-run pays nothing twice).
    pub fn with_rephraser(mut self, provider: Arc<dyn Provider>, root: &RunStore) -> Self {
        self.rephraser = Some(provider);
        self.root = Some(root.clone());
        self
    }

    /// Sets the provider of the rephrase model of table `table` (`rephrase`, `judge` or
    /// `model`, as [`rephrase_models`] names them), where tests name different models: their
    /// calls go to that model's server, not to the first one's.
    pub fn with_rephraser_for(mut self, table: &'static str, provider: Arc<dyn Provider>) -> Self {
        self.rephrasers.push((table, provider));
        self
    }

    /// The provider that answers the rephrase calls of the model of `table`.
    fn rephraser_of(&self, table: &str) -> Option<Arc<dyn Provider>> {
        self.rephrasers
            .iter()
            .find(|(t, _)| *t == table)
            .map(|(_, p)| p.clone())
            .or_else(|| self.rephraser.clone())
    }

    /// `--batch`: the rephrase calls go through the provider's batch interface whatever
    /// the rephrase model's `batch` says.
    pub fn with_batch(mut self, batch: bool) -> Self {
        self.batch = batch;
        self
    }

    /// Whether any test needs a rephrase model.
    pub fn needs_rephraser(&self) -> bool {
        rephrase_model_for(self.p).is_some()
    }

    fn next_base(&mut self) -> Result<Option<Base>, GenerateError> {
        next_base(self.p, &self.plans[self.current], &mut self.cursor)
    }

    fn case(
        &self,
        base: &Base,
        role: &str,
        group: Option<&str>,
        input: String,
        pert: Option<&str>,
    ) -> Case {
        let p = self.p;
        let plan = &self.plans[self.current];
        let test = &p.tests[plan.idx];
        let suite = &p.suite.name;
        let case_id = match group {
            Some(g) => content_hash(&[suite, &test.name, role, g, &input]),
            None => content_hash(&[suite, &test.name, role, &base.template_id, &input]),
        };
        let expected = match (role, &test.perturb) {
            ("perturbed", Some(spec)) => spec.expected().map(String::from).or_else(|| {
                (test.test_type == "INV")
                    .then(|| base.expected.clone())
                    .flatten()
            }),
            _ => base.expected.clone(),
        };
        Case {
            group_id: group.map(String::from).unwrap_or_else(|| case_id.clone()),
            case_id,
            suite: suite.clone(),
            test: test.name.clone(),
            capability: test.capability.clone(),
            test_type: test.test_type.clone(),
            template_id: base.template_id.clone(),
            role: role.to_string(),
            input,
            expected,
            expectation: test.expectation.clone(),
            tolerance: plan.tolerance,
            perturbation: pert.map(String::from),
        }
    }

    /// The next batch of at most about `max` cases (a base and its perturbations are never
    /// split), or `None` when the suite is exhausted. The first call asks the rephrase
    /// model for every paraphrase the suite needs ([`Self::ask_rephrasings`]).
    ///
    /// # Errors
    /// Source read errors (file, row, column), a test that produces no case, and rephrase
    /// failures.
    pub async fn next_batch(&mut self, max: usize) -> Result<Option<Vec<Case>>, GenerateError> {
        if self.groups.is_none() && self.needs_rephraser() {
            self.ask_rephrasings().await?;
        }
        let p = self.p;
        let mut out = Vec::with_capacity(max.min(1 << 16));
        while out.len() < max {
            if self.current >= self.plans.len() {
                break;
            }
            let test = &p.tests[self.plans[self.current].idx];
            let spec = match test.test_type.as_str() {
                "MFT" => None,
                _ => test.perturb.as_ref(),
            };
            let Some(b) = self.next_base()? else {
                if self.cases_in_test == 0 {
                    return Err(p
                        .invalid(
                            &format!("\"{}\"", test.name),
                            "test",
                            format!(
                                "test `{}` produced no cases (does its perturbation apply to its \
                                 templates, and does its source have rows?)",
                                test.name
                            ),
                        )
                        .into());
                }
                self.current += 1;
                self.cursor = None;
                self.cases_in_test = 0;
                self.replies = None;
                continue;
            };
            let before = out.len();
            match spec {
                None => out.push(self.case(&b, "single", None, b.text.clone(), None)),
                Some(spec) if spec.op() == "rephrase" => self.rephrase_base(&b, &mut out).await?,
                Some(spec) => {
                    let base = self.case(&b, "base", None, b.text.clone(), None);
                    let mut rng =
                        SmallRng::seed_from_u64(p.suite.seed ^ hash_u64(&[&base.case_id]));
                    let mut variants: Vec<String> = Vec::new();
                    let mut tries = 0;
                    while variants.len() < test.n_perturb && tries < test.n_perturb * 5 {
                        tries += 1;
                        if let Some(v) = perturb::apply(spec, &b.text, &mut rng)
                            && !variants.contains(&v)
                        {
                            variants.push(v);
                        }
                    }
                    self.push_group(&b, base, variants, spec.op(), &mut out);
                }
            }
            self.cases_in_test += (out.len() - before) as u64;
        }
        Ok((!out.is_empty()).then_some(out))
    }

    fn push_group(
        &self,
        b: &Base,
        base: Case,
        variants: Vec<String>,
        op: &str,
        out: &mut Vec<Case>,
    ) {
        if variants.is_empty() {
            return; // the perturbation does not apply to this base case
        }
        let gid = base.case_id.clone();
        out.push(base);
        for v in variants {
            out.push(self.case(b, "perturbed", Some(&gid), v, Some(op)));
        }
    }

    /// Asks the rephrase model for every paraphrase the suite needs, before any case is
    /// made: the bases of each rephrase test become the cases of its nested run
    /// ([`rephrase::Group`]), whose calls the call stage sends all at once (so a batch-mode
    /// model waits for one batch, not one per base) or finds answered by an earlier run.
    ///
    /// # Errors
    /// No rephrase model set up, a source read error, or the nested call stage's errors.
    async fn ask_rephrasings(&mut self) -> Result<(), GenerateError> {
        let p = self.p;
        let mut groups: Vec<Option<rephrase::Group>> = vec![None; self.plans.len()];
        let mut distinct: Vec<(rephrase::Group, &'static str)> = Vec::new();
        for (i, plan) in self.plans.iter().enumerate() {
            let test = &p.tests[plan.idx];
            let Some(spec) = test.perturb.as_ref() else {
                continue;
            };
            if test.test_type == "MFT" || spec.op() != "rephrase" {
                continue;
            }
            let (table, model) = rephrase_table(p, spec).expect("checked when planning");
            let root = self
                .root
                .as_ref()
                .ok_or_else(|| no_rephraser(model, &test.name))?;
            let prompt = rephrase::prompt_of(spec);
            let g = rephrase::Group::new(root, model, prompt, test.n_perturb, self.batch);
            if !distinct
                .iter()
                .any(|(d, _)| d.store.display() == g.store.display())
            {
                // Rebuilt each time, as the judge's prompts: the same bases, the same ids.
                g.store.delete_dir("cases").await?;
                distinct.push((g.clone(), table));
            }
            groups[i] = Some(g);
        }
        for (i, g) in groups.iter().enumerate() {
            let Some(g) = g else { continue };
            let (plan, mut cursor) = (&self.plans[i], None);
            let test = &p.tests[plan.idx];
            let mut w = g
                .store
                .part_writer("cases", Table::Cases.schema(), &format!("test{i:04}"));
            let (mut seen, mut buf) = (HashSet::new(), Vec::new());
            while let Some(b) = next_base(p, plan, &mut cursor)? {
                if seen.insert(rephrase::Group::case_id(&test.name, &b.text)) {
                    buf.push(g.case(&test.name, &b.text));
                }
                if buf.len() >= 8192 {
                    w.write(to_batch(&std::mem::take(&mut buf))).await?;
                }
            }
            if !buf.is_empty() {
                w.write(to_batch(&buf)).await?;
            }
            w.finish().await?;
        }
        if !distinct.is_empty() {
            // Each nested run's calls go to its own model's provider.
            let mut asks = Vec::new();
            for (g, table) in &distinct {
                let provider = self
                    .rephraser_of(table)
                    .ok_or_else(|| no_rephraser(&g.model, "a rephrase test"))?;
                asks.push((g, provider));
            }
            if distinct.iter().all(|(g, _)| g.model.batch) {
                // Every batch is created before any is waited for.
                futures::future::try_join_all(asks.into_iter().map(|(g, p)| g.ask(p))).await?;
            } else {
                // One at a time: synchronous calls share the provider's rate limits.
                for (g, p) in asks {
                    g.ask(p).await?;
                }
            }
            crate::stages::call::batch::crash_at("after_rephrase");
        }
        self.groups = Some(groups);
        Ok(())
    }

    /// A base of a rephrase test and its paraphrases, from the replies of its nested run
    /// (read once per test).
    async fn rephrase_base(&mut self, b: &Base, out: &mut Vec<Case>) -> Result<(), GenerateError> {
        let test = &self.p.tests[self.plans[self.current].idx];
        if self.replies.as_ref().map(|r| r.0) != Some(self.current) {
            let group = self
                .groups
                .as_ref()
                .and_then(|g| g[self.current].as_ref())
                .expect("asked before the first batch");
            let replies = group.replies(&test.name).await?;
            self.replies = Some((self.current, replies));
        }
        let replies = &self.replies.as_ref().expect("read above").1;
        let variants = match replies.get(&rephrase::Group::case_id(&test.name, &b.text)) {
            Some(r) => rephrase::variants(&b.text, r),
            None => Err("no answer recorded".into()),
        }
        .map_err(|msg| GenerateError::Rephrase {
            test: test.name.clone(),
            input: b.text.clone(),
            msg,
        })?;
        let base = self.case(b, "base", None, b.text.clone(), None);
        self.push_group(b, base, variants, "rephrase", out);
        Ok(())
    }
}

/// The error of a suite that rephrases without a rephrase model set up.
fn no_rephraser(model: &ModelConfig, test: &str) -> GenerateError {
    GenerateError::Call(CallError::Provider(
        model.provider.clone(),
        format!("test `{test}` uses `rephrase` but no rephrase model was set up"),
    ))
}

/// Expands every test of the pipeline's suite into cases, in memory. Use [`CaseStream`]
/// for large suites; this is for tests and small tools.
///
/// # Errors
/// As [`CaseStream::new`] and [`CaseStream::next_batch`]; a suite using `rephrase` needs
/// [`CaseStream::with_rephraser`] and fails here.
pub fn expand(p: &Pipeline) -> Result<Vec<Case>, GenerateError> {
    let mut s = CaseStream::new(p)?;
    let mut all = Vec::new();
    while let Some(b) = futures::executor::block_on(s.next_batch(8192))? {
        all.extend(b);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let perm = Permutation::new(n, 9);
            let mut seen: Vec<u64> = (0..n).map(|i| perm.get(i)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
    }

    #[test]
    fn allocation_keeps_small_templates() {
        assert_eq!(allocate(&[1, 500, 500], 101), vec![1, 50, 50]);
        assert_eq!(allocate(&[3, 4], 100), vec![3, 4]);
    }

    #[test]
    fn articles() {
        assert_eq!(with_article("apple", Article::Lower), "an apple");
        assert_eq!(with_article("flight", Article::Upper), "A flight");
        assert_eq!(with_article("hour", Article::Lower), "an hour");
        assert_eq!(with_article("unusual", Article::Lower), "an unusual");
        assert_eq!(with_article("university", Article::Lower), "a university");
        assert_eq!(with_article("FBI", Article::Lower), "an FBI");
    }
}
