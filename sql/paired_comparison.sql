-- Paired comparison of two runs on the same cases: is B better than A?
--
--   evalflow sql --file sql/paired_comparison.sql --run runs/<run_A> --run runs/<run_B>
--
-- The K samples of a case are averaged per case first, the two runs are joined on case_id, and
-- d = B - A per case (positive means B passes more). The SE of mean(d) is clustered by
-- template_id (Miller 2024). The interval is paired_diff_clustered's default: for pass/fail
-- pairs (one sample per case) the clustered score interval and a clustered McNemar test,
-- for averaged samples or graded scores CR2 floored at the random-intercept variance
-- (docs/functions.md). The MDE is the smallest difference this many cases could
-- detect (alpha 0.05, power 0.8) at the observed clustered SE. Verdict: an interval that
-- excludes zero decides, otherwise the test could not tell, which is not evidence of no change.
-- With one template no clustered interval exists, and the verdict says so rather than fall
-- back to treating cases as independent. Scores may be any number (pass = 1 / fail = 0 for
-- checklist, 1 = recommended for cue, a judge's score): `evalflow compare --scorer NAME[@VERSION]`
-- substitutes the scorer below. Base rows are excluded, each run keeps its greatest
-- scoring_version (edit to choose).
WITH a AS (
    SELECT case_id, test, capability, template_id, avg(score) AS score
    FROM a_scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM a_scores WHERE scorer = 'checklist')
    GROUP BY case_id, test, capability, template_id
),
b AS (
    SELECT case_id, avg(score) AS score
    FROM b_scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM b_scores WHERE scorer = 'checklist')
    GROUP BY case_id
),
pairs AS (
    SELECT a.case_id, a.test, a.capability, a.template_id, a.score AS score_a, b.score AS score_b
    FROM a JOIN b ON a.case_id = b.case_id
),
cmp AS (
    SELECT
        CASE WHEN grouping(capability) = 1 THEN 'overall'
             WHEN grouping(test) = 1 THEN 'capability'
             ELSE 'test' END AS scope,
        COALESCE(capability, '(all)') AS capability,
        COALESCE(test, '(all)') AS test,
        avg(score_a) AS mean_a,
        avg(score_b) AS mean_b,
        count(DISTINCT template_id) AS n_templates,
        paired_diff_clustered(score_b, score_a, template_id) AS d
    FROM pairs
    GROUP BY GROUPING SETS ((capability, test), (capability), ())
)
SELECT
    scope,
    capability,
    test,
    d['n'] AS n_cases,
    n_templates,
    mean_a,
    mean_b,
    d['mean_diff'] AS diff_b_minus_a,
    d['se'] AS se_clustered,
    d['lo'] AS lo95,
    d['hi'] AS hi95,
    d['z'] AS z,
    d['p_value'] AS p_value,
    mde(d['n'], d['se'] * d['se'] * d['n']) AS mde,
    CASE
        WHEN n_templates < 2 THEN 'cannot tell: 1 template, so no clustered interval (a naive one would overstate the evidence)'
        WHEN d['lo'] > 0 THEN 'B better'
        WHEN d['hi'] < 0 THEN 'A better'
        WHEN d['se'] = 0 AND d['mean_diff'] = 0 THEN 'no difference (identical on every case)'
        WHEN d['se'] IS NULL THEN 'could not tell (too few cases or templates)'
        ELSE 'could not tell (difference below the MDE of '
             || CAST(round(mde(d['n'], d['se'] * d['se'] * d['n']), 4) AS VARCHAR) || ')'
    END AS verdict
FROM cmp
ORDER BY scope = 'overall', scope, capability, test
