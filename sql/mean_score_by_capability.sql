-- The mean score of a numeric scorer (judge: the share of its YES/NO checklist answered YES)
-- by capability x test type, with clustered 95% intervals.
--
--   evalflow sql --file sql/mean_score_by_capability.sql --run runs/<run_id>
--
-- Rows whose verdict is not valid_answer (including the judge's own judge_unparseable and
-- judge_error) have a NULL score and are counted beside the mean, never averaged in. The
-- interval is clustered by template_id. Edit 'judge' to report another numeric scorer;
-- `scores` holds every scorer version of the run, this keeps the greatest scoring_version.
WITH s AS (
    SELECT *
    FROM scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'judge' AND scoring_version = (SELECT max(scoring_version) FROM scores WHERE scorer = 'judge')
),
agg AS (
    SELECT
        COALESCE(capability, '(all)') AS capability,
        COALESCE(test_type, '(all)') AS test_type,
        count(*) AS n_rows,
        clustered_mean_ci(score, template_id) AS ci,
        sum(CASE WHEN validity = 'valid_answer' THEN 1 ELSE 0 END) AS valid_answer,
        sum(CASE WHEN validity = 'judge_unparseable' THEN 1 ELSE 0 END) AS judge_unparseable,
        sum(CASE WHEN validity = 'judge_error' THEN 1 ELSE 0 END) AS judge_error,
        sum(CASE WHEN validity NOT IN ('valid_answer', 'judge_unparseable', 'judge_error') THEN 1 ELSE 0 END) AS other_invalid
    FROM s
    GROUP BY GROUPING SETS ((capability, test_type), ())
)
SELECT
    capability,
    test_type,
    ci['n'] AS n_scored,
    ci['n_clusters'] AS n_templates,
    ci['mean'] AS mean_score,
    ci['lo'] AS mean_lo95,
    ci['hi'] AS mean_hi95,
    n_rows,
    valid_answer,
    judge_unparseable,
    judge_error,
    other_invalid
FROM agg
ORDER BY capability = '(all)', capability, test_type = '(all)', test_type
