//! The plans [`ImportSink::finish`] runs over the scratch tables: numbering, the duplicate
//! and `expected` checks, `cases` and the imported scores, each spilling under the memory limit.

use super::*;

impl ImportSink {
    /// Commits every buffered batch and waits for the writer tasks.
    pub(super) async fn commit_scratch(&mut self) -> Result<(), ImportError> {
        let mut failed = None;
        // The chunks still keyed are the stream's last: counted as the others were.
        while let Some(chunk) = self.pending.pop_front() {
            if let Err(e) = self.stage_pending(chunk).await {
                failed = Some(e);
                break;
            }
        }
        // Counting stops with the stream: its map is not needed by the plans.
        self.counts = None;
        if failed.is_none() && self.direct.rows > 0 {
            failed = self.send_direct().await.err();
        }
        // The staging table and the numbering buckets are whole before they are read.
        if failed.is_none() && self.staged.rows > 0 {
            let batch = self.staged.finish();
            failed = self.write_staged(batch).await.err();
        }
        if failed.is_none() {
            failed = self.finish_staging().await.err();
        }
        if failed.is_none() && self.numbers_staged() {
            failed = self.number_staged().await.err();
        }
        // Every writer is joined, even after an error, so none puts a part once `_import/`
        // is deleted; after an error they are not told to commit what they hold.
        let mut written = 0;
        for w in std::mem::take(&mut self.writers) {
            if failed.is_none() {
                // A closed channel means the task stopped on an error, which `join` returns.
                let _ = w.tx.send(ToWriter::Finish).await;
            }
            match w.join().await {
                Ok(n) => written += n,
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        debug_assert_eq!(written, self.direct_rows);
        let batches = [
            (self.cases.rows > 0).then(|| self.cases.finish()),
            (self.sb.rows > 0).then(|| self.sb.finish()),
        ];
        let writers = [self.case_staging.take(), self.score_staging.take()];
        for (batch, w) in batches.into_iter().zip(writers) {
            if let Some(mut w) = w {
                if let Some(b) = batch {
                    w.write(b).await?;
                }
                w.finish().await?;
            }
        }
        // Staged calls may share an id with a direct one, and two direct ones may be equal:
        // the plans check them. Else distinct direct ids held in memory need no check.
        let distinct = self.seen_ids.as_mut().is_none_or(SeenIds::all_distinct);
        if self.staged_rows > 0 || !distinct {
            self.spill_seen_ids().await?;
        }
        self.seen_ids = None;
        for w in std::mem::take(&mut self.ids) {
            w.finish().await?;
        }
        Ok(())
    }

    /// Commits the staging table and the numbering buckets.
    pub(super) async fn finish_staging(&mut self) -> Result<(), ImportError> {
        if let Some(w) = self.staging.take() {
            w.finish().await?;
        }
        if let Some(n) = self.narrow.take() {
            n.finish().await?;
        }
        Ok(())
    }

    pub(super) async fn plan(&self) -> Result<ImportSummary, ImportError> {
        let t = std::time::Instant::now();
        let ctx = new_context();
        self.store.register_with(&ctx);
        ctx.register_udf(call_id_udf());
        crate::query::register_parquet(&ctx, "cs", &self.store.table_url(CASE_STAGING)).await?;
        let (direct, staged) = (self.direct_rows > 0, self.staged_rows > 0);
        if direct {
            crate::query::register_parquet(&ctx, "direct", &self.store.table_url(STAGED_CALLS))
                .await?;
        }
        // Direct ids to check: none when they were all distinct in memory.
        let direct_ids = self.ids_rows > 0;
        if direct_ids {
            crate::query::register_parquet(&ctx, "ids", &self.store.table_url(IDS)).await?;
        }
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            "import: scratch registered"
        );
        let has_scores = !self.tool_scorers.is_empty();
        // Staged records' calls first, then the duplicate check on every call id, then
        // the commit.
        let mut calls = self.direct_rows;
        if staged {
            crate::query::register_parquet(&ctx, "st", &self.store.table_url(STAGING)).await?;
            calls += write_partitioned(
                &ctx,
                // Staged pairs that no direct call shares need no base from `direct`.
                &self.calls_sql(direct && !self.staged_past_counts()),
                &self.store,
                PLANNED_CALLS,
                "part-imported-planned",
                staged_calls_schema(),
            )
            .await?;
            crate::query::register_parquet(
                &ctx,
                "staged_calls",
                &self.store.table_url(PLANNED_CALLS),
            )
            .await?;
        }
        // Records a cross-file copy check dropped before they were numbered.
        let mut duplicates = self.staged_rows + self.direct_rows - calls + self.copies_dropped;
        let t = std::time::Instant::now();
        let (direct_dups, staged_dups) = self.check_duplicates(&ctx, direct_ids, staged).await?;
        tracing::debug!(secs = t.elapsed().as_secs_f64(), "import: duplicate check");
        // Exact copies of one call (the same record twice): keep one, in place of the
        // parts written, by a window that sorts (and spills) only on this path.
        duplicates += direct_dups + staged_dups;
        calls -= direct_dups + staged_dups;
        let cols: Vec<String> = crate::import::calls_schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let one_of_each = |table: &str, order: &str| {
            format!(
                "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY call_id ORDER BY {order})                  AS evalflow_copy FROM \
                 {table}) WHERE evalflow_copy = 1"
            )
        };
        let direct_parts = if direct_dups > 0 {
            write_partitioned(
                &ctx,
                &format!(
                    "SELECT {} FROM ({})",
                    cols.join(", "),
                    one_of_each("direct", "source_file, source_id")
                ),
                &self.store,
                DEDUP_CALLS,
                "part-imported",
                crate::import::calls_schema(),
            )
            .await?;
            ctx.deregister_table("direct")
                .map_err(QueryError::df("import: dropping copies"))?;
            crate::query::register_parquet(&ctx, "direct", &self.store.table_url(DEDUP_CALLS))
                .await?;
            DEDUP_CALLS
        } else {
            STAGED_CALLS
        };
        if staged_dups > 0 {
            let mut staged_cols = cols.clone();
            staged_cols.push("seq".into());
            staged_cols.push("fp".into());
            write_partitioned(
                &ctx,
                &format!(
                    "SELECT {} FROM ({})",
                    staged_cols.join(", "),
                    one_of_each("staged_calls", "seq")
                ),
                &self.store,
                DEDUP_PLANNED,
                "part-imported-planned",
                staged_calls_schema(),
            )
            .await?;
            ctx.deregister_table("staged_calls")
                .map_err(QueryError::df("import: dropping copies"))?;
            crate::query::register_parquet(
                &ctx,
                "staged_calls",
                &self.store.table_url(DEDUP_PLANNED),
            )
            .await?;
        }
        // With each case staged once, no case holds two `expected` and each row is its
        // case's first record ([`DistinctCases`]).
        let distinct = self.distinct_cases.as_ref();
        if self.policy.on_conflicting_expected == OnConflict::Refuse && distinct.is_none() {
            self.check_expected(&ctx).await?;
        }
        let t = std::time::Instant::now();
        let (clustered, cases) = match distinct {
            Some(d) => {
                self.no_cluster_check(d.clustered())?;
                let cases = write_partitioned(
                    &ctx,
                    &self.staged_cases_sql(),
                    &self.store,
                    "cases",
                    "part-imported-00",
                    Table::Cases.schema(),
                )
                .await?;
                (d.clustered(), cases)
            }
            None => self.cases_by_plan(&ctx).await?,
        };
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            rows = self.case_rows,
            distinct = distinct.is_some(),
            "import: cases"
        );
        let mut scores = Vec::new();
        if has_scores {
            crate::query::register_parquet(&ctx, "ss", &self.store.table_url(SCORE_STAGING))
                .await?;
            crate::query::register_parquet(&ctx, "imported_cases", &self.store.table_url("cases"))
                .await?;
            for (tool, scorer) in &self.tool_scorers {
                let dir = format!("scores/{scorer}@imported");
                let n = write_partitioned(
                    &ctx,
                    &scores_sql(tool, scorer, direct),
                    &self.store,
                    &dir,
                    "part-imported",
                    Table::Scores.schema(),
                )
                .await?;
                scores.push((format!("{scorer}@imported"), dir, n));
            }
        }
        if staged {
            // The staged records' calls without `seq`, in the declared columns.
            write_partitioned(
                &ctx,
                &format!("SELECT {} FROM staged_calls", cols.join(", ")),
                &self.store,
                "calls",
                "part-imported-planned",
                crate::import::calls_schema(),
            )
            .await?;
        }
        let os = self.store.object_store();
        for p in self.store.list_parts(direct_parts).await? {
            let name = p.location.filename().unwrap_or_default().to_string();
            crate::storage::retry::rename(
                os.as_ref(),
                &p.location,
                &self.store.path(&format!("calls/{name}")),
            )
            .await
            .map_err(|source| StorageError::Store {
                location: format!("calls/{name}"),
                source,
            })?;
        }
        Ok(ImportSummary {
            cases,
            clustered,
            calls,
            duplicates,
            models: self.models.names(),
            scores,
        })
    }

    /// `cases` found by the plans: each case's first record (`firsts`, slice by slice of
    /// the case ids) joined with its staged fields. Returns the clustered cases and the
    /// cases.
    async fn cases_by_plan(&self, ctx: &SessionContext) -> Result<(u64, u64), ImportError> {
        // Each case's first record, found slice by slice of the case ids (see
        // `query::id_slices`) so no aggregation holds every case.
        let passes = (self.case_rows as usize).div_ceil(pass_rows());
        let mut n_cases = 0;
        for (i, range) in id_slices("case_id", passes).iter().enumerate() {
            n_cases += write_partitioned(
                ctx,
                &format!(
                    "SELECT min(seq) AS first_seq, bool_or(cluster IS NOT NULL) AS clustered, \
                     {expected} AS expected FROM cs WHERE {range} GROUP BY case_id",
                    expected = match self.policy.on_conflicting_expected {
                        OnConflict::Last => "last_value(expected ORDER BY CASE WHEN expected IS NULL THEN 0 ELSE 1 END, seq)",
                        _ => "first_value(expected ORDER BY CASE WHEN expected IS NULL THEN 1 ELSE 0 END, seq)",
                    }
                ),
                &self.store,
                FIRSTS,
                &format!("slice-{i:02}"),
                firsts_schema(),
            )
            .await?;
        }
        crate::query::register_parquet(ctx, "firsts", &self.store.table_url(FIRSTS)).await?;
        let clustered: u64 =
            crate::query::text_rows(ctx, "SELECT count(*) FROM firsts WHERE clustered")
                .await?
                .first()
                .and_then(|r| r[0].as_deref().and_then(|v| v.parse().ok()))
                .unwrap_or(0);
        self.no_cluster_check(clustered)?;
        // The join's build side is `firsts`: taken by ranges of `seq` (corpus order, so the
        // parts keep it), half a pass's ids at a time, it holds that many cases, not every
        // case (about 75 MB at 10M records, 1.25M cases).
        let passes = (n_cases as usize).div_ceil((pass_rows() / 2).max(1)).max(1) as u64;
        let step = self.next_seq.div_ceil(passes).max(1);
        let mut cases = 0;
        for i in 0..passes {
            cases += write_partitioned(
                ctx,
                &self.cases_sql(i * step, (i + 1) * step),
                &self.store,
                "cases",
                &format!("part-imported-{i:02}"),
                Table::Cases.schema(),
            )
            .await?;
        }
        Ok((clustered, cases))
    }

    /// `--cluster` named a field no record has.
    fn no_cluster_check(&self, clustered: u64) -> Result<(), ImportError> {
        match &self.policy.cluster {
            Some(field) if clustered == 0 => Err(ImportError::NoCluster {
                field: field.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// The cases: each case's first record (the one with its lowest `seq`).
    ///
    /// Found by joining the staged case fields with each case's first `seq` (`firsts`,
    /// computed slice by slice of the case ids), not by a `GROUP BY case_id` of
    /// `first_value`s: the aggregate would hold every case's input text until its end
    /// (about 0.7 GB at 10M records); the join holds one integer per case whose first
    /// record is in `[from_seq, to_seq)`. The staging streams past the join in `seq` order,
    /// so each part
    /// lists its cases in the order the corpus names them, the order of the calls parts:
    /// a calls part's cases sit in a few Parquet pages of `cases`, and the score stage's
    /// join (which filters `cases` by the part's case ids while decoding) skips the rest.
    pub(super) fn cases_sql(&self, from_seq: u64, to_seq: u64) -> String {
        format!(
            "SELECT {} FROM firsts f JOIN cs ON cs.seq = f.first_seq \
             WHERE f.first_seq >= {from_seq} AND f.first_seq < {to_seq} \
             AND cs.seq >= {from_seq} AND cs.seq < {to_seq}",
            self.cases_columns("f.expected")
        )
    }

    /// The cases when each was staged once ([`DistinctCases`]): the staged rows, in the
    /// order staged.
    pub(super) fn staged_cases_sql(&self) -> String {
        format!("SELECT {} FROM cs", self.cases_columns("cs.expected"))
    }

    /// The `cases` columns of a staged case row `cs` whose `expected` is `expected`.
    fn cases_columns(&self, expected: &str) -> String {
        let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let d = &self.defaults;
        format!(
            "cs.case_id, 'imported' AS suite, cs.test, cs.capability, {tt} AS test_type, \
             COALESCE(cs.cluster, cs.case_id) AS template_id, \
             cs.case_id AS group_id, {role} AS role, cs.input, {expected} AS expected, \
             CAST(NULL AS VARCHAR) AS expectation, CAST(NULL AS DOUBLE) AS tolerance, \
             CAST(NULL AS VARCHAR) AS perturbation",
            tt = lit(&d.test_type),
            role = lit(&d.role),
        )
    }

    /// The staged records' calls, with their `seq`. A record without a sample index takes
    /// the next after the highest index given for its (case, model), direct or staged.
    pub(super) fn calls_sql(&self, with_direct: bool) -> String {
        // A record of a later file identical to one of an earlier file (the same file
        // twice, two copies of it) is dropped before the samples are numbered: the k-th
        // copy of a record in one file matches the k-th in another, so records repeated
        // within one file (samples that gave the same answer) stay. Only with files to
        // compare and records to number (the others are copies by call id).
        let st = if self.files.len() > 1 && self.missing_samples > 0 && !self.policy.keep_duplicates
        {
            "(SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY fp, evalflow_k ORDER BY \
             file_idx, seq) AS evalflow_first FROM (SELECT *, CASE WHEN given_sample_idx IS NULL \
             THEN row_number() OVER (PARTITION BY file_idx, fp ORDER BY seq) ELSE 0 END AS \
             evalflow_k FROM st)) WHERE evalflow_first = 1)"
        } else {
            "st"
        };
        // Without missing sample indices no window (and no sort) is needed.
        let source = if self.missing_samples == 0 {
            format!("SELECT *, given_sample_idx AS sample_idx FROM {st}")
        } else {
            let given = if with_direct {
                "SELECT case_id, model, sample_idx AS s FROM direct UNION ALL "
            } else {
                ""
            };
            format!(
                "SELECT st.*, COALESCE(st.given_sample_idx, CAST(COALESCE(g.base, 0) + \
                 row_number() OVER (PARTITION BY st.case_id, st.model, st.given_sample_idx IS NULL \
                 ORDER BY st.seq) - 1 AS INT)) AS sample_idx FROM {st} st LEFT JOIN \
                 (SELECT case_id, model, max(s) + 1 AS base FROM ({given}SELECT case_id, model, \
                  given_sample_idx AS s FROM st WHERE given_sample_idx IS NOT NULL) \
                  GROUP BY case_id, model) g \
                 ON st.case_id = g.case_id AND st.model = g.model"
            )
        };
        format!(
            "SELECT evalflow_call_id(case_id, model, sample_idx, request_hash) AS call_id, \
             case_id, model, provider, sample_idx, request_hash, response, \
             CAST(NULL AS DOUBLE) AS response_score, response_hash, finish_reason, \
             prompt_tokens, completion_tokens, reasoning_tokens, reasoning_chars, http_status, \
             error, attempts, latency_ms, max_tokens, temperature, started_at, \
             CAST(NULL AS BOOLEAN) AS retried_for_budget, CAST(NULL AS VARCHAR) AS batch_id, \
             source_format, source_file, source_id, seq, fp FROM ({source})"
        )
    }

    /// Fails on the first call id that two different records share, and counts the
    /// exact copies (records whose call id and [`Keys::fp`] are another's) of the direct
    /// (`direct`: those in the ids table, see [`SeenIds`]) and of the staged calls, which
    /// the caller drops.
    ///
    /// Call ids are hex digests, so their first two digits split them into 256 even slices; the
    /// check runs one `GROUP BY call_id` per range of slices, each over at most about
    /// [`pass_rows`] ids, so its hash table stays the same size whatever the
    /// corpus (one pass over all 10M ids held about 0.6 GB) for one more read of the
    /// ids per pass.
    pub(super) async fn check_duplicates(
        &self,
        ctx: &SessionContext,
        direct: bool,
        staged: bool,
    ) -> Result<(u64, u64), ImportError> {
        if !direct && !staged {
            return Ok((0, 0));
        }
        let union = |cols: &str| {
            let mut from = Vec::new();
            if direct {
                from.push(format!(
                    "SELECT {cols} FROM {}",
                    if cols.contains("seq") {
                        "ids"
                    } else {
                        "direct"
                    }
                ));
            }
            if staged {
                from.push(format!("SELECT {cols} FROM staged_calls"));
            }
            from.join(" UNION ALL ")
        };
        let ids = union("call_id, seq, fp");
        let passes = (self.rows() as usize).div_ceil(pass_rows());
        let mut id = None;
        let (mut direct_dups, mut staged_dups) = (0u64, 0u64);
        // Each call id's records (of the direct and of the staged calls) and whether their
        // fingerprints differ, in one scan per slice. `min(fp) <> max(fp)`, not
        // `count(DISTINCT fp) > 1`: DataFusion's grouped distinct count keeps a hash set per
        // group, row by row (1M ids: 22 s and 1.1 GB, against under a second).
        let mut tagged = Vec::new();
        if direct {
            tagged.push("SELECT call_id, fp, 1 AS d FROM ids");
        }
        if staged {
            tagged.push("SELECT call_id, fp, 0 AS d FROM staged_calls");
        }
        let tagged = tagged.join(" UNION ALL ");
        for range in id_slices("call_id", passes) {
            let sql = format!(
                "SELECT max(CASE WHEN n > 1 AND differ THEN call_id END), \
                 sum(CASE WHEN nd > 1 THEN nd - 1 ELSE 0 END), \
                 sum(CASE WHEN n - nd > 1 THEN n - nd - 1 ELSE 0 END) \
                 FROM (SELECT call_id, count(*) AS n, min(fp) <> max(fp) AS differ, sum(d) AS nd \
                 FROM ({tagged}) WHERE {range} GROUP BY call_id HAVING count(*) > 1)"
            );
            let rows = crate::query::text_rows(ctx, &sql).await?;
            let cell = |c: usize| -> u64 {
                rows.first()
                    .and_then(|r| r[c].as_deref())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            id = rows.first().and_then(|r| r[0].clone());
            if id.is_some() {
                break;
            }
            direct_dups += cell(1);
            staged_dups += cell(2);
        }
        let Some(id) = id else {
            return Ok((direct_dups, staged_dups));
        };
        // Name the two records: a failure path, so more scans are fine.
        let seqs = crate::query::text_rows(
            ctx,
            &format!("SELECT seq FROM ({ids}) WHERE call_id = '{id}' ORDER BY seq"),
        )
        .await?;
        let call = crate::query::text_rows(
            ctx,
            &format!(
                "SELECT k.model, k.sample_idx, k.source_file, cs.input FROM ({}) k \
                 JOIN cs ON k.case_id = cs.case_id WHERE k.call_id = '{id}' LIMIT 1",
                union("call_id, case_id, model, sample_idx, source_file")
            ),
        )
        .await?;
        let get = |c: usize| call.first().and_then(|r| r[c].clone()).unwrap_or_default();
        let seq = |r: Option<&Vec<Option<String>>>| {
            r.and_then(|r| r[0].as_deref())
                .and_then(|s| s.parse::<u64>().ok())
                .map_or(0, |s| s + 1)
        };
        Err(ImportError::Duplicate {
            source_name: get(2),
            input: get(3),
            model: get(0),
            sample_idx: get(1).parse().unwrap_or(0),
            first: seq(seqs.first()),
            second: seq(seqs.last()),
        })
    }

    /// Fails on the first case whose records give two different `expected` answers,
    /// naming both records (`file:line`), slice by slice of the case ids as the first
    /// record search does.
    pub(super) async fn check_expected(&self, ctx: &SessionContext) -> Result<(), ImportError> {
        let passes = (self.case_rows as usize).div_ceil(pass_rows());
        for range in id_slices("case_id", passes) {
            let rows = crate::query::text_rows(
                ctx,
                &format!(
                    "SELECT case_id FROM cs WHERE {range} AND expected IS NOT NULL \
                     GROUP BY case_id HAVING min(expected) <> max(expected) LIMIT 1"
                ),
            )
            .await?;
            let Some(id) = rows.first().and_then(|r| r[0].clone()) else {
                continue;
            };
            let recs = crate::query::text_rows(
                ctx,
                &format!(
                    "SELECT source_file, source_id, expected, input FROM cs \
                     WHERE case_id = '{id}' AND expected IS NOT NULL ORDER BY seq"
                ),
            )
            .await?;
            let at = |r: &Vec<Option<String>>| {
                format!(
                    "{}:{}",
                    r[0].as_deref().unwrap_or(""),
                    r[1].as_deref().unwrap_or("?")
                )
            };
            let first = &recs[0];
            let second = recs
                .iter()
                .find(|r| r[2] != first[2])
                .expect("two distinct expected answers");
            return Err(ImportError::ConflictingExpected {
                first_at: at(first),
                second_at: at(second),
                input: first[3].clone().unwrap_or_default(),
                first: first[2].clone().unwrap_or_default(),
                second: second[2].clone().unwrap_or_default(),
            });
        }
        Ok(())
    }
}

/// Ids one pass of a `GROUP BY` over call or case ids (the duplicate check, each case's
/// first record) takes at most, the same at any corpus size. With 1M, the duplicate check
/// of a 10M-record import peaked about 80 MB above a 1M-record one (an import's peak);
/// with 500k it stays under the streaming phase's, for about 1 s more of its 40.
/// `EVALFLOW_IMPORT_PASS_ROWS` sets another (tests use a small one to run many passes).
pub(super) fn pass_rows() -> usize {
    crate::config::env_count("EVALFLOW_IMPORT_PASS_ROWS").map_or(500_000, |n| n as usize)
}

/// Each case's first `seq`, and whether a record of it named a cluster.
pub(super) fn firsts_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("first_seq", DataType::UInt64, true),
        Field::new("clustered", DataType::Boolean, true),
        Field::new("expected", DataType::Utf8, true),
    ]))
}

/// The staged calls: an imported calls table plus the record's `seq`.
pub(super) fn staged_calls_schema() -> SchemaRef {
    let mut fields: Vec<Field> = crate::import::calls_schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("seq", DataType::UInt64, false));
    fields.push(Field::new("fp", DataType::Utf8, false));
    Arc::new(Schema::new(fields))
}
/// One imported scores version: a row for every call of the tool (NULL where the tool did
/// not score it), with the case's fields as the scores table carries them.
///
/// The tool's records with no score of their own went straight to `calls` (no `seq` to
/// join on): they are in the version with a NULL score.
pub(super) fn scores_sql(tool: &str, scorer: &str, with_direct: bool) -> String {
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let cols = "call_id, case_id, model, sample_idx, response_hash, error, http_status, \
                source_format";
    let calls = if with_direct {
        format!(
            "(SELECT {cols}, seq FROM staged_calls UNION ALL \
             SELECT {cols}, CAST(NULL AS BIGINT UNSIGNED) AS seq FROM direct)"
        )
    } else {
        "staged_calls".to_string()
    };
    format!(
        "SELECT k.call_id, k.case_id, k.model, k.sample_idx, {scorer} AS scorer, \
         'imported' AS scoring_version, k.response_hash, \
         CASE WHEN k.error IS NOT NULL OR (k.http_status IS NOT NULL AND \
         (k.http_status < 200 OR k.http_status > 299)) THEN 'provider_error' \
         ELSE 'valid_answer' END AS validity, \
         s.score, s.label, CAST(NULL AS DOUBLE) AS prob, s.passed, s.detail, NULL AS answers, \
         c.test, c.capability, c.test_type, c.role, c.template_id \
         FROM {calls} k JOIN imported_cases c ON k.case_id = c.case_id \
         LEFT JOIN (SELECT * FROM ss WHERE scorer = {scorer}) s ON k.seq = s.seq \
         WHERE (CASE k.source_format WHEN 'openai-batch' THEN 'openai' ELSE k.source_format END) = {tool}",
        scorer = lit(scorer),
        tool = lit(tool),
    )
}

/// Runs `sql` and writes each output partition through its own part writer under `dir`, in
/// parallel (Parquet encoding is the costly part); returns the rows written.
pub(super) async fn write_partitioned(
    ctx: &SessionContext,
    sql: &str,
    store: &RunStore,
    dir: &str,
    prefix: &str,
    schema: SchemaRef,
) -> Result<u64, ImportError> {
    let what = format!("import: writing {dir}");
    let streams = ctx
        .sql(sql)
        .await
        .map_err(QueryError::df(what.clone()))?
        .execute_stream_partitioned()
        .await
        .map_err(QueryError::df(what.clone()))?;
    let mut tasks = Vec::new();
    for (k, mut s) in streams.into_iter().enumerate() {
        let (store, schema, dir, what, prefix) = (
            store.clone(),
            schema.clone(),
            dir.to_string(),
            what.clone(),
            prefix.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            let mut w = store.part_writer(&dir, schema.clone(), &format!("{prefix}-{k:03}"));
            let mut rows = 0u64;
            while let Some(b) = s.next().await {
                let b = conform(b.map_err(QueryError::df(what.clone()))?, &schema)
                    .map_err(|e| QueryError::df(what.clone())(e.into()))?;
                rows += b.num_rows() as u64;
                w.write(b).await?;
            }
            w.finish().await?;
            Ok::<u64, ImportError>(rows)
        }));
    }
    let mut rows = 0;
    for t in tasks {
        rows += t.await.map_err(|e| {
            QueryError::df(what.clone())(datafusion::error::DataFusionError::External(Box::new(e)))
        })??;
    }
    Ok(rows)
}

/// Casts a plan's batch to a table's schema (same column order; an all-NULL column of no
/// type becomes NULLs of the declared type).
pub(super) fn conform(
    b: RecordBatch,
    schema: &SchemaRef,
) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    let cols = b
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else if c.data_type() == &DataType::Null {
                Ok(new_null_array(f.data_type(), c.len()))
            } else {
                cast(c, f.data_type())
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(schema.clone(), cols)
}
/// `evalflow_call_id(case_id, model, sample_idx, request_hash)`: the call stage's call id, so
/// imported calls get exactly the ids a live run of the same requests would.
pub(super) fn call_id_udf() -> ScalarUDF {
    create_udf(
        "evalflow_call_id",
        vec![
            DataType::Utf8,
            DataType::Utf8,
            DataType::Int32,
            DataType::Utf8,
        ],
        DataType::Utf8,
        Volatility::Immutable,
        Arc::new(|args: &[ColumnarValue]| {
            let arrays = ColumnarValue::values_to_arrays(args)?;
            let (case, model, sample, req) = (
                arrays[0].as_string::<i32>(),
                arrays[1].as_string::<i32>(),
                arrays[2].as_primitive::<Int32Type>(),
                arrays[3].as_string::<i32>(),
            );
            let out: StringArray = (0..case.len())
                .map(|i| {
                    Some(call::call_id(
                        case.value(i),
                        model.value(i),
                        sample.value(i),
                        req.value(i),
                    ))
                })
                .collect();
            Ok(ColumnarValue::Array(Arc::new(out)))
        }),
    )
}
