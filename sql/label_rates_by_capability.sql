-- The rate of each label of a label scorer (cue: recommended / rejected / neutral / absent) by
-- capability x test type, with clustered 95% intervals.
--
--   evalflow sql --file sql/label_rates_by_capability.sql --run runs/<run_id>
--
-- A label scorer's verdict is its label, not pass/fail: each label's rate is the mean of the
-- indicator "this row has the label" over valid, scored rows, and its interval is clustered
-- by template_id like every other interval here (clipped to [0, 1]). Rows whose validity is
-- not valid_answer have no label and are left out (count them with results_by_capability.sql
-- or the validity table). Edit 'cue' to report another label scorer; `scores` holds every
-- scorer version of the run, this keeps the greatest scoring_version.
WITH s AS (
    SELECT capability, test_type, template_id, label
    FROM scores
    WHERE (role IS DISTINCT FROM 'base')
      AND scorer = 'cue' AND scoring_version = (SELECT max(scoring_version) FROM scores WHERE scorer = 'cue')
      AND score IS NOT NULL AND label IS NOT NULL
),
labels AS (
    SELECT DISTINCT label AS lab FROM s
),
x AS (
    SELECT s.capability, s.test_type, s.template_id, l.lab,
           CASE WHEN s.label = l.lab THEN 1.0 ELSE 0.0 END AS hit
    FROM s CROSS JOIN labels l
),
agg AS (
    SELECT
        COALESCE(capability, '(all)') AS capability,
        COALESCE(test_type, '(all)') AS test_type,
        lab AS label,
        sum(hit) AS hits,
        clustered_mean_ci(hit, template_id) AS ci
    FROM x
    GROUP BY GROUPING SETS ((capability, test_type, lab), (lab))
)
SELECT
    capability,
    test_type,
    label,
    ci['n'] AS n_scored,
    CAST(hits AS BIGINT) AS n_label,
    ci['mean'] AS rate,
    greatest(0.0, ci['lo']) AS rate_lo95,
    least(1.0, ci['hi']) AS rate_hi95,
    ci['n_clusters'] AS n_templates
FROM agg
ORDER BY capability = '(all)', capability, test_type, label
