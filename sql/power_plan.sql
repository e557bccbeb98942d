-- Power plan from a pilot pair of runs: how many cases does a paired comparison need?
--
--   evalflow sql --file sql/power_plan.sql --run runs/<pilot_A> --run runs/<pilot_B>
--
-- Miller (2024): n = (z_{alpha/2} + z_{1-power})^2 * var_d / delta^2, where var_d is the
-- variance of per-case differences. With K samples per case,
--   var_d(K) = omega^2 + (sigma_A^2 + sigma_B^2) / K,
-- where sigma^2 is the within-case sampling variance (variance_components) and omega^2
-- the variance of true per-case differences: var_samp(d) of the pilot minus its own sampling
-- part. The clustered column inflates var_d by the pilot design effect
-- (clustered SE / naive SE)^2, floored at 1, for cases that share templates; with one
-- template the design effect is unknown and cases_needed_clustered is NULL, never the naive
-- number in disguise. `evalflow plan --scorer NAME[@VERSION]` substitutes the scorer below.
WITH a_case AS (
    SELECT case_id, template_id, avg(score) AS score, count(score) AS k
    FROM a_scores
    WHERE (role IS DISTINCT FROM 'base') AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM a_scores WHERE scorer = 'checklist')
    GROUP BY case_id, template_id
),
b_case AS (
    SELECT case_id, avg(score) AS score, count(score) AS k
    FROM b_scores
    WHERE (role IS DISTINCT FROM 'base') AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM b_scores WHERE scorer = 'checklist')
    GROUP BY case_id
),
pilot AS (
    SELECT
        count(*) AS n_cases,
        count(DISTINCT a.template_id) AS n_templates,
        var_samp(b.score - a.score) AS var_d,
        mean_se(b.score - a.score) AS se_naive,
        clustered_se(b.score - a.score, a.template_id) AS se_clustered,
        paired_diff_clustered(b.score, a.score, a.template_id) AS d,
        avg(a.k) AS k_a,
        avg(b.k) AS k_b
    FROM a_case a JOIN b_case b ON a.case_id = b.case_id
    WHERE a.score IS NOT NULL AND b.score IS NOT NULL
),
noise AS (
    SELECT
        (SELECT variance_components(score, case_id)['within_var'] FROM a_scores
          WHERE (role IS DISTINCT FROM 'base') AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM a_scores WHERE scorer = 'checklist')) AS sigma2_a,
        (SELECT variance_components(score, case_id)['within_var'] FROM b_scores
          WHERE (role IS DISTINCT FROM 'base') AND scorer = 'checklist' AND scoring_version = (SELECT max(scoring_version) FROM b_scores WHERE scorer = 'checklist')) AS sigma2_b
),
parts AS (
    SELECT
        p.*,
        COALESCE(n.sigma2_a, 0.0) AS sigma2_a,
        COALESCE(n.sigma2_b, 0.0) AS sigma2_b,
        greatest(0.0, p.var_d - COALESCE(n.sigma2_a, 0.0) / p.k_a - COALESCE(n.sigma2_b, 0.0) / p.k_b) AS omega2,
        CASE WHEN p.se_clustered IS NULL THEN NULL
             WHEN p.se_naive > 0 THEN greatest(1.0, (p.se_clustered / p.se_naive) * (p.se_clustered / p.se_naive))
             ELSE 1.0 END AS design_effect
    FROM pilot p CROSS JOIN noise n
),
plan AS (
    SELECT t.delta, k.k, parts.*,
           parts.omega2 + (parts.sigma2_a + parts.sigma2_b) / k.k AS var_d_k
    FROM parts
    CROSS JOIN (VALUES (0.01), (0.02), (0.03), (0.05), (0.10)) AS t(delta)
    CROSS JOIN (VALUES (1), (2), (4), (8)) AS k(k)
)
SELECT
    delta,
    k AS samples_per_case,
    n_cases AS pilot_cases,
    var_d AS pilot_var_d,
    omega2,
    sigma2_a,
    sigma2_b,
    var_d_k,
    sample_size(delta, var_d_k) AS cases_needed,
    sample_size(delta, var_d_k * design_effect) AS cases_needed_clustered,
    -- The smallest difference the pilot itself could detect (80% power, alpha 0.05), from its
    -- clustered interval as `evalflow compare` reports it: NULL with fewer than 2 templates.
    mde(1, power((d['hi'] - d['lo']) / (2 * 1.959963984540054), 2)) AS pilot_mde,
    n_templates AS pilot_templates,
    CASE WHEN design_effect IS NULL
         THEN 'no clustered plan: the pilot has fewer than 2 templates, so its design effect is unknown'
         ELSE 'clustered by template' END AS clustering
FROM plan
ORDER BY delta, k
