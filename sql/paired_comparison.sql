-- Paired comparison of two runs on the same cases: is B better than A?
--
--   evalflow sql --file sql/paired_comparison.sql --run runs/<run_A> --run runs/<run_B>
--
-- The K samples of a case are averaged per case first (a sample with no score, such as a
-- provider error, is left out of its case's mean), and the two runs are paired on case_id. A
-- pair counts only when the case is scored in both runs: every number of a row (n_pairs,
-- templates, mean_a, mean_b, diff, the interval and the MDE) comes from those pairs, so
-- diff = mean_b - mean_a exactly. A case scored in one run only is counted in n_unpaired and
-- left out of everything else. d = B - A per case (positive means B scores higher). The
-- interval is paired_diff_clustered's default, clustered by template_id: for pass/fail pairs
-- (one sample per case) the clustered score interval and a clustered McNemar test, for
-- averaged samples or graded scores CR2 floored at the random-intercept variance
-- (docs/functions.md). The MDE is the smallest difference detectable with 80% power at alpha
-- 0.05 at the SE the printed interval implies, (hi - lo) / (2 z_0.975), so it is never
-- smaller than the interval is wide (a zero `se` with a score interval of positive width does
-- not give an MDE of 0). Verdict: an interval that excludes zero decides, otherwise the test
-- could not tell, which is not evidence of no change. With one template no clustered interval
-- exists, and the verdict says so rather than fall back to treating cases as independent.
-- Scores may be any number (pass = 1 / fail = 0 for checklist, 1 = recommended for cue, a
-- judge's score): `evalflow compare --scorer NAME[@VERSION]` substitutes the scorer below.
-- Base rows are excluded, each run keeps its greatest scoring_version (edit to choose).
-- capability and test are '(all)' on the rows that pool them.
WITH a AS (
    SELECT case_id, test, capability, template_id, avg(score) AS score
    FROM a_scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM a_scores WHERE scorer = 'checklist')
    GROUP BY case_id, test, capability, template_id
),
b AS (
    SELECT case_id, test, capability, template_id, avg(score) AS score
    FROM b_scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM b_scores WHERE scorer = 'checklist')
    GROUP BY case_id, test, capability, template_id
),
joined AS (
    SELECT
        COALESCE(a.test, b.test) AS test,
        COALESCE(a.capability, b.capability) AS capability,
        COALESCE(a.template_id, b.template_id) AS template_id,
        a.score AS score_a,
        b.score AS score_b
    FROM a FULL OUTER JOIN b ON a.case_id = b.case_id
),
pairs AS (
    SELECT
        test, capability, template_id,
        CASE WHEN paired THEN score_a END AS score_a,
        CASE WHEN paired THEN score_b END AS score_b,
        CASE WHEN paired THEN template_id END AS paired_template,
        CASE WHEN (score_a IS NULL) <> (score_b IS NULL) THEN 1 ELSE 0 END AS unpaired
    FROM (
        SELECT *, score_a IS NOT NULL AND score_b IS NOT NULL AND template_id IS NOT NULL AS paired
        FROM joined
    ) AS j
),
cmp AS (
    SELECT
        CASE WHEN grouping(capability) = 1 THEN 'overall'
             WHEN grouping(test) = 1 THEN 'capability'
             ELSE 'test' END AS level,
        COALESCE(capability, '(all)') AS capability,
        COALESCE(test, '(all)') AS test,
        CAST(sum(unpaired) AS BIGINT) AS n_unpaired,
        avg(score_a) AS mean_a,
        avg(score_b) AS mean_b,
        count(DISTINCT paired_template) AS templates,
        paired_diff_clustered(score_b, score_a, paired_template) AS d
    FROM pairs
    GROUP BY GROUPING SETS ((capability, test), (capability), ())
),
summary AS (
    SELECT
        level, capability, test,
        d['n'] AS n_pairs,
        n_unpaired,
        mean_a,
        mean_b,
        mean_b - mean_a AS diff,
        d['se'] AS se,
        d['lo'] AS lo,
        d['hi'] AS hi,
        templates,
        mde(1, power((d['hi'] - d['lo']) / (2 * 1.959963984540054), 2)) AS mde,
        d['method'] AS method,
        d['z'] AS z,
        d['p_value'] AS p_value,
        d['se'] = 0 AND d['mean_diff'] = 0 AS identical
    FROM cmp
)
SELECT
    level, capability, test, n_pairs, n_unpaired, mean_a, mean_b, diff, se, lo, hi, templates,
    mde, method,
    CASE
        WHEN n_pairs = 0 THEN 'cannot tell: no case is scored in both runs'
        WHEN templates < 2 THEN 'cannot tell: 1 template, so no clustered interval (a naive one would overstate the evidence)'
        WHEN lo > 0 THEN 'B better'
        WHEN hi < 0 THEN 'A better'
        WHEN identical THEN 'no difference (identical on every paired case)'
        WHEN se IS NULL OR mde IS NULL THEN 'could not tell (too few cases or templates)'
        ELSE 'could not tell (difference below the MDE of '
             || CAST(round(mde, 4) AS VARCHAR) || ')'
    END AS verdict,
    z,
    p_value
FROM summary
ORDER BY level = 'overall', level, capability, test
