//! Coverage of the clustered interval methods on simulated evals with known truth.
//!
//! Each design: G templates, cluster sizes equal (10 cases) or unequal (uniform 1 to 50 cases,
//! drawn per replication), a template effect on the logit scale with intra-template
//! correlation rho on the latent scale (sigma^2 = rho / (1 - rho) * pi^2 / 3, as in the issue's
//! simulation), and the population pass rate (the estimand) near 0.5 or 0.05: the logit
//! intercept is solved so that E[expit(a + sigma u)] is exactly the target. Cases are
//! Bernoulli given their template. The rare rate is run twice: fixed at exactly 0.05, and
//! drawn per replication from 201 evenly spaced rates in [0.04, 0.06] ("0.04-0.06"). With 200
//! cases (20 templates of 10) the counts are a lattice, and the coverage of any interval for
//! counts swings by 3 points as the true rate moves by 0.005 (`scripts/lattice_coverage.py`:
//! plain Wilson covers 96.7% at exactly 0.05, 93.4-96.8% across [0.04, 0.06]); a rate drawn
//! from a neighbourhood averages that swing out, as Brown, Cai and DasGupta (2001) judge
//! binomial intervals, and is what "a rate near 0.05" means for an eval whose true rate is
//! unknown. 2,000 replications per design (seeded), every method of
//! `evalflow::udaf::cluster_interval` run on the same data, by calling the Rust math directly.
//!
//! Printed per design: coverage of the nominal 95% interval and its mean width relative to the
//! oracle width 2 x 1.96 x (the estimator's true SD across replications). The summary per
//! method is what issue 16's target reads: coverage from G = 20 (94-96%), at G = 10 (93% or
//! more), and the worst mean width over the oracle's (at most 1.15). Then the paired
//! version: two versions A and B on the same cases, d = b - a, B's logit shifted by delta
//! plus a template-specific shift (sd sigma / 2), common random numbers on half the cases.
//! Last, graded judge scores (issue 61): each case scores 0, 0.5 or 1, the mean of two
//! Bernoulli draws at its template's rate, with template effects as above (rho 0.05, 0.3) or
//! none at all (rho 0: every template has the same mean, where CR2 alone gave zero-width
//! intervals); the share of zero-width intervals of `auto` and `cr2` is printed beside them.
//!
//!     cargo bench --bench coverage                    # release (slow to build here)
//!     cargo bench --profile dev --bench coverage      # dev build, deps at opt-level 2
//!     EVALFLOW_COVERAGE_REPS=500 EVALFLOW_COVERAGE_BOOT=199 cargo bench ...
//!     EVALFLOW_COVERAGE_SECTIONS=graded cargo bench ...  # rates, paired, graded (default all)
//!
//! `EVALFLOW_COVERAGE_BOOT` sets the bootstrap's B (default 399 here to keep the run short;
//! the SQL default is 999: a smaller B adds a little noise to the critical value, not bias).

use std::time::Instant;

use evalflow::udaf::cluster_interval::{
    Bootstrap, ClusterInterval, IntervalSpec, Method, binary_cell, cluster_interval,
    paired_interval,
};
use evalflow::udaf::common::Moments;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const GS: [usize; 5] = [5, 10, 20, 40, 100];
const RHOS: [f64; 2] = [0.05, 0.3];
const LEVEL: f64 = 0.95;
const Z95: f64 = 1.959_963_984_540_054;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn expit(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn normal(rng: &mut SmallRng) -> f64 {
    // Box-Muller.
    let u1: f64 = 1.0 - rng.gen_range(0.0..1.0);
    let u2: f64 = rng.gen_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// E[expit(a + sigma u)], u standard normal, by the trapezoid rule on [-10, 10].
fn logit_normal_mean(a: f64, sigma: f64) -> f64 {
    let k = 4000;
    let h = 20.0 / k as f64;
    let (mut s, mut w) = (0.0, 0.0);
    for i in 0..=k {
        let u = -10.0 + h * i as f64;
        let phi = (-0.5 * u * u).exp();
        s += phi * expit(a + sigma * u);
        w += phi;
    }
    s / w
}

/// The intercept whose population mean is `mu` (bisection).
fn intercept_for(mu: f64, sigma: f64) -> f64 {
    let (mut lo, mut hi) = (-30.0, 30.0);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if logit_normal_mean(mid, sigma) < mu {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

#[derive(Clone, Copy)]
struct Design {
    g: usize,
    unequal: bool,
    rho: f64,
}

impl Design {
    fn sigma(&self) -> f64 {
        (self.rho / (1.0 - self.rho) * std::f64::consts::PI.powi(2) / 3.0).sqrt()
    }

    fn size(&self, rng: &mut SmallRng) -> u64 {
        if self.unequal {
            rng.gen_range(1..=50)
        } else {
            10
        }
    }
}

#[derive(Default, Clone)]
struct Tally {
    covered: usize,
    width: f64,
    defined: usize,
    /// Defined intervals of zero width.
    zero: usize,
}

impl Tally {
    fn add(&mut self, lo: Option<f64>, hi: Option<f64>, truth: f64) {
        // An undefined interval (e.g. every case equal) counts as a miss of zero width.
        if let (Some(lo), Some(hi)) = (lo, hi) {
            self.defined += 1;
            self.width += hi - lo;
            if hi - lo <= 0.0 {
                self.zero += 1;
            }
            if lo <= truth && truth <= hi {
                self.covered += 1;
            }
        }
    }
}

struct Outcome {
    tallies: Vec<Tally>,
    sd: f64,
    reps: usize,
}

fn sd(xs: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
}

/// Runs `reps` replications: `draw` fills the per-template cells and returns the truth of
/// that replication; `interval` is the method's interval on the cells.
fn run(
    methods: &[Method],
    reps: usize,
    boot: Bootstrap,
    seed: u64,
    interval: impl Fn(&[Moments], &IntervalSpec) -> ClusterInterval,
    mut draw: impl FnMut(&mut SmallRng, &mut Vec<Moments>) -> f64,
) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tallies = vec![Tally::default(); methods.len()];
    let mut means = Vec::with_capacity(reps);
    let mut cells = Vec::new();
    for rep in 0..reps {
        cells.clear();
        let truth = draw(&mut rng, &mut cells);
        for (m, t) in methods.iter().zip(&mut tallies) {
            // A user runs one seed; across replications the seed varies, so the table shows
            // the method's coverage, not one seed's luck with B draws.
            let spec = IntervalSpec {
                method: *m,
                level: LEVEL,
                bootstrap: Bootstrap {
                    seed: boot.seed + rep as u64,
                    ..boot
                },
                icc: None,
            };
            let ci = interval(&cells, &spec);
            t.add(ci.lo, ci.hi, truth);
        }
        let mut tot = Moments::default();
        cells.iter().for_each(|c| tot.merge(c));
        // The oracle's SD is the estimator's error's, which is its SD for a fixed truth.
        means.push(tot.mean - truth);
    }
    Outcome {
        tallies,
        sd: sd(&means),
        reps,
    }
}

fn cell_text(t: &Tally, reps: usize, oracle: f64) -> String {
    let cov = 100.0 * t.covered as f64 / reps as f64;
    let w = if t.defined > 0 {
        t.width / t.defined as f64 / oracle
    } else {
        f64::NAN
    };
    format!("{cov:.1}% ({w:.2})")
}

#[derive(Default)]
struct Summary {
    /// Per method: (min coverage at G >= 20, max coverage at G >= 20, min at G = 10, max width
    /// ratio at G = 10, max width ratio at G >= 20).
    per: Vec<(f64, f64, f64, f64, f64)>,
}

impl Summary {
    fn new(k: usize) -> Self {
        Summary {
            per: vec![(f64::INFINITY, 0.0, f64::INFINITY, 0.0, 0.0); k],
        }
    }

    fn add(&mut self, g: usize, out: &Outcome, oracle: f64) {
        for (p, t) in self.per.iter_mut().zip(&out.tallies) {
            let cov = 100.0 * t.covered as f64 / out.reps as f64;
            let w = t.width / t.defined.max(1) as f64 / oracle;
            if g >= 20 {
                p.0 = p.0.min(cov);
                p.1 = p.1.max(cov);
                p.4 = p.4.max(w);
            }
            if g == 10 {
                p.2 = p.2.min(cov);
                p.3 = p.3.max(w);
            }
        }
    }

    fn print(&self, methods: &[Method]) {
        println!(
            "\n| method | coverage range, G >= 20 | worst coverage, G = 10 | worst width / oracle, G >= 20 | worst width / oracle, G = 10 |"
        );
        println!("|---|---|---|---|---|");
        for (m, p) in methods.iter().zip(&self.per) {
            println!(
                "| {} | {:.1}% to {:.1}% | {:.1}% | {:.2} | {:.2} |",
                m.name(),
                p.0,
                p.1,
                p.2,
                p.4,
                p.3
            );
        }
    }
}

fn header(methods: &[Method], first: &str) {
    let names: Vec<&str> = methods.iter().map(|m| m.name()).collect();
    println!("| {first} | {} | oracle width |", names.join(" | "));
    println!("|{}", "---|".repeat(methods.len() + 2));
}

fn main() {
    let reps = env_usize("EVALFLOW_COVERAGE_REPS", 2000);
    let boot = Bootstrap {
        reps: env_usize("EVALFLOW_COVERAGE_BOOT", 399) as u32,
        seed: 7,
    };
    let started = Instant::now();
    println!(
        "coverage of nominal 95% intervals, {reps} replications per design, bootstrap B = {}; \
         cells: coverage (mean width / oracle width)\n",
        boot.reps
    );

    let sections = std::env::var("EVALFLOW_COVERAGE_SECTIONS").unwrap_or_default();
    let want = |name: &str| sections.is_empty() || sections.split(',').any(|s| s.trim() == name);
    let mut seed = 1u64;
    if want("rates") {
        rates(reps, boot, &mut seed);
    }
    if want("paired") {
        paired(reps, boot, &mut seed);
    }
    if want("graded") {
        graded(reps, boot);
    }
    println!("\nelapsed {:.1} s", started.elapsed().as_secs_f64());
}

/// Means of pass/fail scores.
fn rates(reps: usize, boot: Bootstrap, seed: &mut u64) {
    // `logit_normal` and the stated ICC have their own grid: scripts/stated_icc.py.
    let methods: Vec<Method> = Method::ALL
        .into_iter()
        .filter(|m| *m != Method::LogitNormal)
        .collect();
    println!("### Mean of a pass/fail score\n");
    header(&methods, "G, sizes, rho, mean");
    // Judged with the rare rate fixed at 0.05, and with it drawn from [0.04, 0.06].
    let mut fixed = Summary::new(methods.len());
    let mut near = Summary::new(methods.len());
    // (label, the rates a replication draws its truth from, evenly spaced).
    let rates: [(&str, f64, f64, usize); 3] = [
        ("0.5", 0.5, 0.5, 1),
        ("0.05", 0.05, 0.05, 1),
        ("0.04-0.06", 0.04, 0.06, 201),
    ];
    for (label, lo, hi, k) in rates {
        for unequal in [false, true] {
            for rho in RHOS {
                for g in GS {
                    let d = Design { g, unequal, rho };
                    let sigma = d.sigma();
                    let grid: Vec<(f64, f64)> = (0..k)
                        .map(|i| {
                            let mu = lo + (hi - lo) * i as f64 / (k.max(2) - 1) as f64;
                            (mu, intercept_for(mu, sigma))
                        })
                        .collect();
                    *seed += 1;
                    let out = run(
                        &methods,
                        reps,
                        boot,
                        *seed,
                        cluster_interval,
                        |rng, cells| {
                            let (mu, a) = grid[rng.gen_range(0..grid.len())];
                            for _ in 0..d.g {
                                let n = d.size(rng);
                                let p = expit(a + sigma * normal(rng));
                                let k = (0..n).filter(|_| rng.gen_bool(p)).count() as u64;
                                cells.push(binary_cell(n, k));
                            }
                            mu
                        },
                    );
                    let oracle = 2.0 * Z95 * out.sd;
                    if k == 1 {
                        fixed.add(g, &out, oracle);
                    }
                    if lo != 0.05 {
                        near.add(g, &out, oracle);
                    }
                    let cells: Vec<String> = out
                        .tallies
                        .iter()
                        .map(|t| cell_text(t, reps, oracle))
                        .collect();
                    println!(
                        "| {g}, {}, {rho}, {label} | {} | {oracle:.4} |",
                        if unequal { "1-50" } else { "10" },
                        cells.join(" | ")
                    );
                }
            }
        }
    }
    println!("\nRates 0.5 and exactly 0.05:");
    fixed.print(&methods);
    println!("\nRates 0.5 and drawn from [0.04, 0.06]:");
    near.print(&methods);
}

/// Paired differences of pass/fail pairs.
fn paired(reps: usize, boot: Bootstrap, seed: &mut u64) {
    // Paired differences of pass/fail pairs: `auto` is `cr2_score` for them.
    let methods: Vec<Method> = evalflow::udaf::paired_diff_clustered::METHODS
        .into_iter()
        .filter(|m| *m != Method::Auto)
        .collect();
    println!("\n### Paired difference d = b - a (pass rate of A near the given mean)\n");
    header(&methods, "G, sizes, rho, mean A");
    let mut summary = Summary::new(methods.len());
    let delta = 0.5; // logit shift of B
    for mu in [0.5, 0.1] {
        for unequal in [false, true] {
            for rho in RHOS {
                for g in GS {
                    let d = Design { g, unequal, rho };
                    let sigma = d.sigma();
                    let tau = sigma / 2.0;
                    let a = intercept_for(mu, sigma);
                    let sigma_b = (sigma * sigma + tau * tau).sqrt();
                    let truth = logit_normal_mean(a + delta, sigma_b) - mu;
                    *seed += 1;
                    let paired = |c: &[Moments], s: &IntervalSpec| paired_interval(c, s, true);
                    let out = run(&methods, reps, boot, *seed, paired, |rng, cells| {
                        for _ in 0..d.g {
                            let n = d.size(rng);
                            let u = normal(rng);
                            let pa = expit(a + sigma * u);
                            let pb = expit(a + delta + sigma * u + tau * normal(rng));
                            let mut m = Moments::default();
                            for _ in 0..n {
                                let ua: f64 = rng.gen_range(0.0..1.0);
                                let ub: f64 = if rng.gen_bool(0.5) {
                                    ua
                                } else {
                                    rng.gen_range(0.0..1.0)
                                };
                                let x = f64::from(u8::from(ub < pb)) - f64::from(u8::from(ua < pa));
                                m.push(x);
                            }
                            cells.push(m);
                        }
                        truth
                    });
                    let oracle = 2.0 * Z95 * out.sd;
                    summary.add(g, &out, oracle);
                    let cells: Vec<String> = out
                        .tallies
                        .iter()
                        .map(|t| cell_text(t, reps, oracle))
                        .collect();
                    println!(
                        "| {g}, {}, {rho}, {mu} | {} | {oracle:.4} |",
                        if unequal { "1-50" } else { "10" },
                        cells.join(" | ")
                    );
                }
            }
        }
    }
    summary.print(&methods);
}

/// Means of graded judge scores (0, 0.5, 1): the mean of two Bernoulli draws at the
/// template's rate expit(a + sigma u), so the truth is the population rate `mu` exactly.
/// rho 0 gives every template the same mean.
fn graded(reps: usize, boot: Bootstrap) {
    let methods = Method::ALL;
    println!("\n### Mean of a graded score (0, 0.5, 1)\n");
    let names: Vec<&str> = methods.iter().map(|m| m.name()).collect();
    println!(
        "| G, sizes, rho, mean | {} | oracle width | zero width: auto, cr2 |",
        names.join(" | ")
    );
    println!("|{}", "---|".repeat(methods.len() + 3));
    let mut summary = Summary::new(methods.len());
    let mut seed = 6100u64;
    let auto = methods.iter().position(|m| *m == Method::Auto).unwrap_or(0);
    let cr2 = methods.iter().position(|m| *m == Method::Cr2).unwrap_or(0);
    for mu in [0.5, 0.1] {
        for unequal in [false, true] {
            for rho in [0.0, 0.05, 0.3] {
                for g in GS {
                    let d = Design { g, unequal, rho };
                    let sigma = d.sigma();
                    let a = intercept_for(mu, sigma);
                    seed += 1;
                    let out = run(
                        &methods,
                        reps,
                        boot,
                        seed,
                        cluster_interval,
                        |rng, cells| {
                            for _ in 0..d.g {
                                let n = d.size(rng);
                                let p = expit(a + sigma * normal(rng));
                                let mut m = Moments::default();
                                for _ in 0..n {
                                    let k = u8::from(rng.gen_bool(p)) + u8::from(rng.gen_bool(p));
                                    m.push(0.5 * f64::from(k));
                                }
                                cells.push(m);
                            }
                            mu
                        },
                    );
                    let oracle = 2.0 * Z95 * out.sd;
                    summary.add(g, &out, oracle);
                    let cells: Vec<String> = out
                        .tallies
                        .iter()
                        .map(|t| cell_text(t, reps, oracle))
                        .collect();
                    let zero = |i: usize| 100.0 * out.tallies[i].zero as f64 / reps as f64;
                    println!(
                        "| {g}, {}, {rho}, {mu} | {} | {oracle:.4} | {:.1}%, {:.1}% |",
                        if unequal { "1-50" } else { "10" },
                        cells.join(" | "),
                        zero(auto),
                        zero(cr2)
                    );
                }
            }
        }
    }
    summary.print(&methods);
}
