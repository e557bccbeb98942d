//! Tests of the pairs reader: request keys, the request cache, blocks and pipes.

use super::*;

/// The request key is the request as `Value` writes it, whether the line's request text
/// is reused from the line before or parsed again, and however the file spaced it.
#[test]
fn request_keys_do_not_depend_on_spacing_or_reuse() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.jsonl");
    let resp = r#""response": {"choices": [{"message": {"content": "ok"}}]}"#;
    let a =
        r#"{"temperature": 0.5, "model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
    let b = r#"{"messages":[{"content":"hi","role":"user"}],"model":"m","temperature":0.5}"#;
    let lines = [
        format!(r#"{{"request": {a}, {resp}, "sample_idx": 0}}"#),
        format!(r#"{{"request": {a}, {resp}, "sample_idx": 1}}"#),
        format!(r#"{{"sample_idx": 2, {resp}, "request": {b}}}"#),
        format!(r#"{{"request": {a}, "response": null, "error": "boom", "sample_idx": 3}}"#),
    ];
    std::fs::write(&p, lines.join("\n")).unwrap();
    let records: Vec<Record> = open(&p, &Options::default())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let want = serde_json::from_str::<Value>(a).unwrap().to_string();
    let want = crate::stages::call::sha_prefix(&[&want], 32);
    assert_eq!(records.len(), 4);
    for (i, r) in records.iter().enumerate() {
        assert_eq!(
            r.request.request_hash.as_deref(),
            Some(want.as_str()),
            "line {}",
            i + 1
        );
        assert_eq!((&*r.request.input, &*r.request.model), ("hi", "m"));
        assert_eq!(r.request.temperature, Some(0.5));
        assert_eq!(r.sample_idx, Some(i as i32));
    }
    assert_eq!(records[0].response.as_deref(), Some("ok"));
    assert_eq!(records[3].response, None);
    assert_eq!(records[3].error.as_deref(), Some("boom"));
}

/// Requests interleaved in any order give each line the record its request gives read
/// alone: the cache of requests read lately holds them by their exact text, and a
/// shard that fills turns over (two generations) without losing a request's fields.
#[test]
fn cached_requests_give_the_records_of_a_fresh_read() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.jsonl");
    let resp = r#""response": {"choices": [{"message": {"content": "ok"}}]}"#;
    let reqs = [
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}"#,
        r#"{"model": "n", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "中文"}], "max_tokens": 7}"#,
        concat!(
            r#"{"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "assistant","#,
            r#" "content": "b"}, {"role": "user", "content": "hi"}]}"#,
        ),
    ];
    let alone: Vec<Record> = reqs
        .iter()
        .map(|q| {
            std::fs::write(&p, format!(r#"{{"request": {q}, {resp}}}"#)).unwrap();
            open(&p, &Options::default())
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
        })
        .collect();
    let order = [0, 1, 2, 3, 1, 0, 3, 2, 2, 0, 1, 3, 0];
    let lines: Vec<String> = order
        .iter()
        .map(|&i| format!(r#"{{"request": {}, {resp}}}"#, reqs[i]))
        .collect();
    std::fs::write(&p, lines.join("\n")).unwrap();
    let got: Vec<Record> = open(&p, &Options::default())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(got.len(), order.len());
    for (k, (&i, r)) in order.iter().zip(&got).enumerate() {
        let want = Record {
            source: Provenance {
                id: Some((k + 1).to_string()),
                ..alone[i].source.clone()
            },
            ..alone[i].clone()
        };
        assert_eq!(r, &want, "line {}", k + 1);
    }
    assert_ne!(got[0].request.case_key, got[1].request.case_key);
    let cache = RequestCache::default();
    let parsed = |i: usize| {
        let v: Value = serde_json::from_str(reqs[i % reqs.len()]).unwrap();
        shared(request(&p, 1, &v, "imported").unwrap(), &None, &cache).unwrap()
    };
    let hit = |cache: &RequestCache, text: &str| match cache.get(text_hash(text)) {
        Cached::Hit(rq) => Some(rq),
        _ => None,
    };
    for k in 0..CACHED_REQUESTS * 2 {
        let text = format!("{k}");
        if let Cached::Miss = cache.get(text_hash(&text)) {
            cache.put(text_hash(&text), parsed(k));
        }
        let back = hit(&cache, &text).unwrap();
        assert_eq!(back.request_hash, parsed(k).request_hash);
    }
    let held = (0..CACHED_REQUESTS * 2)
        .filter(|k| hit(&cache, &format!("{k}")).is_some())
        .count();
    assert!(
        held > CACHED_REQUESTS / 2 && held <= 2 * CACHED_REQUESTS,
        "{held}"
    );
}

/// The case id a line's request gives is computed for the file's test (`--test`, else
/// "imported") from the record's own fields, as the sink would compute it.
#[test]
fn case_ids_are_computed_for_the_files_test() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.jsonl");
    let resp = r#""response": {"choices": [{"message": {"content": "ok"}}]}"#;
    std::fs::write(
        &p,
        [
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            serde_json::json!({
                "model": "m",
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                "temperature": 0
            }),
        ]
        .map(|req| format!(r#"{{"request": {req}, {resp}}}"#))
        .join("\n"),
    )
    .unwrap();
    for test in [None, Some("t")] {
        let opts = Options {
            test: test.map(String::from),
            ..Options::default()
        };
        let records: Vec<Record> = open(&p, &opts).unwrap().collect::<Result<_, _>>().unwrap();
        assert_eq!(records.len(), 2);
        assert!(records[0].request.case_key.is_none() && records[1].request.case_key.is_some());
        for r in records.iter().map(|r| &*r.request) {
            let t = test.unwrap_or("imported");
            let want =
                super::super::case_id(t, r.case_key.as_deref(), r.system.as_deref(), &r.input);
            let (got_test, got) = r.case_id.clone().unwrap();
            assert_eq!((&*got_test, &*got), (t, want.as_str()));
        }
    }
}

/// A cache whose lookups rarely hit goes cold after [`COLD_AFTER`] windows: it looks up and
/// keeps one request text in [`COLD_SAMPLE`] (always the same ones), and warms up again once
/// those hit.
#[test]
fn a_cache_that_rarely_hits_goes_cold_and_warms_up_again() {
    let v: Value =
        serde_json::from_str(r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#)
            .unwrap();
    let cache = RequestCache::default();
    let rq = shared(
        request(Path::new("c.jsonl"), 1, &v, "imported").unwrap(),
        &None,
        &cache,
    )
    .unwrap();
    // A lookup counted toward the hit rate at once (a parse slice counts them in batches).
    let look = |h: u128| {
        let found = cache.get(h);
        if !matches!(found, Cached::Skipped) {
            cache.count(1, u32::from(matches!(found, Cached::Hit(_))));
        }
        found
    };
    let skipped = |prefix: &str| {
        (0..1600)
            .filter(|k| matches!(look(text_hash(&format!("{prefix}{k}"))), Cached::Skipped))
            .count()
    };
    assert_eq!(skipped("warm"), 0);
    // Windows of texts never seen again: no hit. The cache stays warm for the first few.
    for k in 0..STATS_WINDOW * COLD_AFTER {
        if k == STATS_WINDOW * (COLD_AFTER - 1) {
            assert_eq!(skipped("still-warm"), 0);
        }
        let text = format!("once{k}");
        if let Cached::Miss = look(text_hash(&text)) {
            cache.put(text_hash(&text), rq.clone());
        }
    }
    let cold = skipped("cold");
    assert!(
        (1350..1600).contains(&cold),
        "{cold} of 1600 skipped, about 15/16"
    );
    // The sampled texts are always the same ones.
    assert_eq!(skipped("cold"), cold);
    // Sampled texts that come back hit, and a window of hits warms the cache up.
    let sampled: Vec<String> = (0..1600)
        .map(|k| format!("cold{k}"))
        .filter(|t| !matches!(look(text_hash(t)), Cached::Skipped))
        .collect();
    for t in &sampled {
        if let Cached::Miss = look(text_hash(t)) {
            cache.put(text_hash(t), rq.clone());
        }
    }
    let mut hits = 0;
    for t in sampled.iter().cycle().take(STATS_WINDOW as usize) {
        hits += usize::from(matches!(look(text_hash(t)), Cached::Hit(_)));
    }
    assert!(hits > STATS_WINDOW as usize / 2, "{hits}");
    assert_eq!(skipped("warm-again"), 0);
}

/// A response the one-pass read refuses is read again as raw text with the same result
/// the `Value` path gives, but a fractional token count is an error: a key named
/// twice (the last wins), no choice (the error naming `response`), a content that is
/// not text (its error); a well-formed one is read in the first pass.
#[test]
fn responses_the_one_pass_read_refuses_are_read_as_raw_text() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.jsonl");
    let req = r#""request": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
    let read = |resp: &str| {
        std::fs::write(&p, format!(r#"{{{req}, "response": {resp}}}"#)).unwrap();
        open(&p, &Options::default()).unwrap().next().unwrap()
    };
    let ok = read(
        r#"{"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}"#,
    )
    .unwrap();
    assert_eq!(
        (ok.response.as_deref(), ok.finish_reason.as_deref()),
        (Some("a"), Some("stop"))
    );
    assert_eq!((ok.prompt_tokens, ok.completion_tokens), (Some(3), Some(1)));
    // A token count that is not an integer is refused with its field, never a NULL.
    let fractional = read(
        r#"{"choices": [{"message": {"content": "b"}}], "usage": {"prompt_tokens": 3.5, "completion_tokens": 2}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        fractional
            .ends_with("c.jsonl:1: field `response.usage.prompt_tokens`: `3.5` is not an integer"),
        "{fractional}"
    );
    let twice = read(
        r#"{"choices": [{"message": {"content": "first"}}], "choices": [{"message": {"content": "last"}}]}"#,
    )
    .unwrap();
    assert_eq!(twice.response.as_deref(), Some("last"));
    let none = read(r#"{"choices": []}"#).unwrap_err().to_string();
    assert!(
        none.contains("c.jsonl:1") && none.contains("response") && none.contains("choices[0]"),
        "{none}"
    );
    let number = read(r#"{"choices": [{"message": {"content": 5}}]}"#)
        .unwrap_err()
        .to_string();
    assert!(number.contains("message.content is 5"), "{number}");
}

/// Over several read blocks: every line read once, in order, `source_id` its line number
/// (CRLF, blank lines and a last line without newline as `BufRead::lines` sees them), and
/// a bad line in the third block named by its own number.
#[test]
fn lines_across_blocks_keep_their_numbers() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.jsonl");
    let line = |i: usize| {
        // About 1 kB a line, so the file spans three blocks.
        let pad = "x".repeat(900 + i % 97);
        format!(
            concat!(
                r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i} {pad}"}}]}},"#,
                r#" "response": {{"choices": [{{"message": {{"content": "a{i}"}}}}]}}}}"#,
            ),
            i = i,
            pad = pad
        )
    };
    let n = 3 * BLOCK_BYTES / 1000;
    let mut text = String::new();
    for i in 1..=n {
        text.push_str(&line(i));
        // CRLF on every seventh line, a blank line after every 1000th.
        text.push_str(if i % 7 == 0 { "\r\n" } else { "\n" });
        if i % 1000 == 0 && i < n {
            text.push('\n');
        }
    }
    text.pop(); // no newline after the last line
    assert!(text.len() > 2 * BLOCK_BYTES);
    std::fs::write(&p, &text).unwrap();
    let records: Vec<Record> = open(&p, &Options::default())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(records.len(), n);
    for (k, r) in records.iter().enumerate() {
        let i = k + 1;
        // Line numbers count the blank lines before this record.
        let line_no = i + (i - 1) / 1000;
        assert_eq!(
            r.source.id.as_deref(),
            Some(line_no.to_string().as_str()),
            "record {i}"
        );
        assert!(r.request.input.starts_with(&format!("q{i} ")), "record {i}");
        assert_eq!(r.response.as_deref(), Some(format!("a{i}").as_str()));
    }
    // A line that is not JSON, deep in the file: its number, found across the blocks.
    let bad_at = 2 * n / 3 + 5;
    let mut lines: Vec<String> = (1..=n).map(line).collect();
    lines[bad_at - 1] = "{not json".into();
    std::fs::write(&p, lines.join("\n")).unwrap();
    let err = open(&p, &Options::default())
        .unwrap()
        .find_map(Result::err)
        .expect("the bad line is an error");
    assert!(
        err.to_string()
            .starts_with(&format!("{}:{bad_at}: field `(line)`", p.display())),
        "{err}"
    );
}

/// A file that cannot be mapped (a named pipe) is read into buffers instead: the same
/// records, with the same line numbers, across blocks.
#[cfg(unix)]
#[test]
fn a_pipe_is_read_as_a_file_is_mapped() {
    let d = tempfile::tempdir().unwrap();
    let (file, pipe) = (d.path().join("c.jsonl"), d.path().join("p.jsonl"));
    let n = 3 * BLOCK_BYTES / 1000;
    let text: String = (1..=n)
        .map(|i| {
            let pad = "y".repeat(900 + i % 89);
            format!(
                concat!(
                    r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i} {pad}"}}]}},"#,
                    r#" "response": {{"choices": [{{"message": {{"content": "a{i}"}}}}]}}}}"#,
                ),
                i = i,
                pad = pad
            ) + if i % 500 == 0 { "\n\n" } else { "\n" }
        })
        .collect();
    std::fs::write(&file, &text).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&pipe)
        .status()
        .unwrap();
    assert!(made.success());
    let writer = {
        let (pipe, text) = (pipe.clone(), text.clone());
        std::thread::spawn(move || std::fs::write(pipe, text).unwrap())
    };
    let read = |p: &Path| -> Vec<(Option<String>, String)> {
        open(p, &Options::default())
            .unwrap()
            .map(|r| {
                let r = r.unwrap();
                (r.source.id, r.request.input.to_string())
            })
            .collect()
    };
    let (mapped, piped) = (read(&file), read(&pipe));
    writer.join().unwrap();
    assert_eq!(mapped.len(), n);
    assert_eq!(
        mapped[n - 1].0.as_deref(),
        Some((n + (n - 1) / 500).to_string().as_str())
    );
    assert_eq!(mapped, piped);
}

/// A bad line is an error in its place and the lines after it are still read, so an
/// import can name every bad line (or skip them), not only the first.
#[test]
fn a_bad_line_in_a_later_block_is_named_and_the_lines_after_it_still_read() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("c.jsonl");
    let n = 3 * BLOCK_BYTES / 1000;
    let bad_at = n - 7;
    let text: String = (1..=n)
        .map(|i| {
            if i == bad_at {
                return r#"{"request": {"model": "m", "messages": []}, "response": 5}"#
                    .to_string()
                    + "\n";
            }
            let pad = "y".repeat(900 + i % 89);
            format!(
                concat!(
                    r#"{{"request": {{"model": "m", "messages": [{{"role": "user", "content": "q{i} {pad}"}}]}},"#,
                    r#" "response": {{"choices": [{{"message": {{"content": "a{i}"}}}}]}}}}"#,
                ),
                i = i,
                pad = pad
            ) + "\n"
        })
        .collect();
    std::fs::write(&file, &text).unwrap();
    let got: Vec<_> = open(&file, &Options::default()).unwrap().collect();
    // Every line in order, the bad one an error, the ones after it records.
    assert_eq!(got.len(), n);
    for (i, r) in got.iter().enumerate() {
        if i + 1 == bad_at {
            continue;
        }
        let r = r.as_ref().unwrap();
        assert_eq!(r.source.id.as_deref(), Some((i + 1).to_string().as_str()));
    }
    let e = got[bad_at - 1].as_ref().err().unwrap();
    let err = e.to_string();
    assert!(
        err.contains(&format!("c.jsonl:{bad_at}")) && err.contains("request.messages"),
        "{err}"
    );
    // The error carries the line itself, for --skip-bad-lines.
    assert_eq!(
        e.to_json()["line"],
        r#"{"request": {"model": "m", "messages": []}, "response": 5}"#
    );
}

/// A field read straight from its text is the value a parse gives: integers (zero, the
/// longest read directly, longer, negative, fractional, exponents), strings with and
/// without escapes, unicode, and the other JSON shapes.
#[test]
fn scalars_read_from_their_text_equal_a_parse() {
    for raw in [
        "0",
        "7",
        "123456789012345678",
        "1234567890123456789",
        "18446744073709551616",
        "-3",
        "2.5",
        "1e3",
        "1.0",
        r#""positive""#,
        r#""""#,
        r#""中文 ok""#,
        r#""a\"b""#,
        r#""\u00e9\n""#,
        "null",
        "true",
        "[1, 2]",
        r#"{"code": 429}"#,
    ] {
        let want: Value = serde_json::from_str(raw).unwrap();
        assert_eq!(scalar(raw), want, "{raw}");
    }
}

/// A request read as types gives the [`ParsedRequest`] its `Value` gives, field by field (the
/// hash of its key, its case key and case id included), for every shape it reads; the
/// shapes it declines are left to the `Value` path.
#[test]
fn typed_requests_equal_the_value_path() {
    let read = [
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
        r#"{"messages": [{"content": "hi", "role": "user"}], "model": "m"}"#,
        r#"{"messages": [{"role": "user", "content": "no model"}]}"#,
        r#"{"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}"#,
        r#"{"model": "m", "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 512, "temperature": 1.0}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0.70}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 1e-3}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 0}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2147483647}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}"#,
        r#"{"model": "m", "messages": [{"role": "system", "content": "s1"}, {"role": "system", "content": "s2"}, {"role": "user", "content": "q"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#,
        r#"{"model": "m", "messages": [{"role": "tool", "content": "t"}, {"role": "user", "content": ""}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "say \"hi\"\n\ttab \\ \u00e9 \ud83d\ude00 中文 \u0001"}]}"#,
        r#"{"model": "m\u00e9", "messages": [{"role": "user", "content": "</script>"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"compact"}],"max_tokens":7}"#,
        r#"{"model": "n", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}"#,
        r#"{"model": "n", "messages": [{"role": "user", "content": "q"}], "max_tokens": 512, "temperature": 1.0}"#,
    ];
    let declined = [
        r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q", "name": "n"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "seed": 3}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": null}"#,
        r#"{"model": null, "messages": [{"role": "user", "content": "q"}]}"#,
        r#"{"model": "m", "model": "n", "messages": [{"role": "user", "content": "q"}]}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2147483648}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 5.0}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": -1}"#,
        r#"{"model": "m", "messages": [{"role": "system", "content": "s"}]}"#,
        r#"{"model": "m", "messages": []}"#,
        r#"{"model": "m", "messages": [["user", "q"]]}"#,
        r#"{"model": 5, "messages": [{"role": "user", "content": "q"}]}"#,
    ];
    let mut shared_case = 0;
    for test in ["imported", "t"] {
        let cache = RequestCache::new(test);
        for text in read {
            let v: Value = serde_json::from_str(text).unwrap();
            let want = request(Path::new("c.jsonl"), 1, &v, test).unwrap();
            let got = typed_request::request(text, test, None)
                .unwrap_or_else(|| panic!("declined {text}"));
            assert_eq!(got, want, "{text}");
            // After any other line's request: the same, its texts shared when the case is.
            for before in read {
                let last = shared(
                    typed_request::request(before, test, None).unwrap(),
                    &Some("m".into()),
                    &cache,
                )
                .unwrap();
                let got = typed_request::request(text, test, Some(&last)).unwrap();
                assert_eq!(got, want, "{text} after {before}");
                let same = (&last.system, &last.input, &last.case_key)
                    == (&want.system, &want.input, &want.case_key);
                assert_eq!(
                    Arc::ptr_eq(&got.input, &last.input),
                    same,
                    "{text} after {before}"
                );
                shared_case += usize::from(same && text != before);
            }
        }
        for text in declined {
            assert!(typed_request::request(text, test, None).is_none(), "{text}");
        }
    }
    // Three cases are sent twice (the first two lines, spaced otherwise; and two requests to
    // "m" then "n"), each pair in both orders, for each test.
    assert_eq!(shared_case, 2 * 3 * 2, "pairs sharing a case");
}

/// A parse slice counts its lookups toward the cache's hit rate in batches, and what it
/// has not yet added when it ends is added then: no lookup goes uncounted.
#[test]
fn a_slices_lookups_are_all_counted() {
    use std::sync::atomic::Ordering;
    let cache = RequestCache::default();
    {
        let mut seen = Seen::new(&cache);
        for k in 0..COUNT_BATCH + 5 {
            assert!(matches!(
                seen.lookup(text_hash(&format!("{k}"))),
                Cached::Miss
            ));
        }
        assert_eq!(cache.lookups.load(Ordering::Relaxed), COUNT_BATCH);
    }
    assert_eq!(cache.lookups.load(Ordering::Relaxed), COUNT_BATCH + 5);
    assert_eq!(cache.hits.load(Ordering::Relaxed), 0);
}

/// Every request naming a model gets the same `Arc` of its name (so the sink can tell
/// models by pointer), distinct models stay distinct, and past `SHARED_MODELS` names are
/// returned as given.
#[test]
fn requests_share_one_arc_per_model() {
    let cache = RequestCache::default();
    let a1 = cache.shared_model(Arc::from("gpt-4o"));
    let b = cache.shared_model(Arc::from("claude"));
    let a2 = cache.shared_model(Arc::from("gpt-4o"));
    assert!(Arc::ptr_eq(&a1, &a2));
    assert!(!Arc::ptr_eq(&a1, &b));
    assert_eq!((&*a2, &*b), ("gpt-4o", "claude"));
    for k in 2..SHARED_MODELS {
        cache.shared_model(Arc::from(format!("m{k}").as_str()));
    }
    let late = Arc::<str>::from("late");
    let got = cache.shared_model(late.clone());
    assert!(Arc::ptr_eq(&got, &late));
    let again = cache.shared_model(Arc::from("late"));
    assert!(!Arc::ptr_eq(&again, &late));
    assert_eq!(&*again, "late");
}
