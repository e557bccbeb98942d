-- Results by capability x test type, with clustered 95% intervals and the validity distribution.
--
--   evalflow sql --file sql/results_by_capability.sql --run runs/<run_id>
--
-- Scores are 1.0 (pass) / 0.0 (fail): the failure rate is 1 - mean(score) and its interval is
-- [1 - hi, 1 - lo] of the mean interval. The standard error is the clustered SE of Miller (2024) with
-- template_id as the cluster: cases generated from one template share their wording, so they
-- are not independent. Base rows (role = 'base') carry no score of their own and are excluded.
-- Rows whose validity is not valid_answer have a NULL score: they are ignored by the statistics
-- and reported in the validity columns instead.
-- `scores` holds every scorer version of the run: this keeps the greatest scoring_version,
-- edit the filter to pick another.
WITH s AS (
    SELECT *
    FROM scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM scores WHERE scorer = 'checklist')
),
agg AS (
    SELECT
        COALESCE(capability, '(all)') AS capability,
        COALESCE(test_type, '(all)') AS test_type,
        count(*) AS n_rows,
        clustered_mean_ci(score, template_id) AS ci,
        avg(CASE WHEN validity = 'valid_answer' THEN 1.0 ELSE 0.0 END) AS valid_answer,
        avg(CASE WHEN validity = 'empty_due_to_budget' THEN 1.0 ELSE 0.0 END) AS empty_due_to_budget,
        avg(CASE WHEN validity = 'empty_unexplained' THEN 1.0 ELSE 0.0 END) AS empty_unexplained,
        avg(CASE WHEN validity = 'truncated' THEN 1.0 ELSE 0.0 END) AS truncated,
        avg(CASE WHEN validity = 'provider_error' THEN 1.0 ELSE 0.0 END) AS provider_error,
        avg(CASE WHEN validity = 'unscorable_language' THEN 1.0 ELSE 0.0 END) AS unscorable_language
    FROM s
    GROUP BY GROUPING SETS ((capability, test_type), (capability), ())
)
SELECT
    capability,
    test_type,
    ci['n'] AS n_scored,
    ci['n_clusters'] AS n_templates,
    1.0 - ci['mean'] AS failure_rate,
    greatest(0.0, 1.0 - ci['hi']) AS failure_lo95,
    least(1.0, 1.0 - ci['lo']) AS failure_hi95,
    ci['se'] AS se_clustered,
    n_rows,
    valid_answer,
    empty_due_to_budget,
    empty_unexplained,
    truncated,
    provider_error,
    unscorable_language
FROM agg
ORDER BY capability = '(all)', capability, test_type = '(all)', test_type
