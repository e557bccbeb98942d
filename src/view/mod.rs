//! `evalflow view`: a read-only viewer of the runs under a root, as one page application and
//! a JSON API (docs/view.md) served by axum.
//!
//! The server does the work and the browser holds one page: answers come 50 at a time from a
//! positional scan of the run's Parquet parts ([`answers`]), one answer by bloom-filtered
//! point lookups, and the SQL box runs DataFusion under the process's memory pool. Nothing
//! here writes: no lease is taken, no pending compaction is finished, and a malformed run is
//! listed with its error instead of stopping the server.
//!
//! The page's JavaScript and CSS (`assets/`) are compiled into the binary: no build step, no
//! other origin.

mod answers;
mod catalog;
mod diff;
mod keys;
mod rows;
mod sql_box;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

pub use catalog::Catalog;

/// Errors of the viewer: each becomes a JSON `{"error"}` with its status.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The request names something that is not there, or asks for something malformed.
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unauthorized(String),
    /// Reading a run failed.
    #[error(transparent)]
    Query(#[from] crate::query::QueryError),
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
    /// The server could not start (address in use, a non-loopback address without a token).
    #[error("{0}")]
    Start(String),
}

impl ViewError {
    fn status(&self) -> StatusCode {
        match self {
            ViewError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ViewError::NotFound(_) => StatusCode::NOT_FOUND,
            ViewError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ViewError::Query(e) if e.is_bad_input() => StatusCode::BAD_REQUEST,
            ViewError::Storage(e) if e.is_bad_input() => StatusCode::UNPROCESSABLE_ENTITY,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ViewError {
    fn into_response(self) -> Response {
        (
            self.status(),
            axum::Json(json!({"error": self.to_string()})),
        )
            .into_response()
    }
}

type ApiResult = Result<axum::Json<Value>, ViewError>;

/// What `evalflow view` serves.
#[derive(Debug, Clone)]
pub struct ViewConfig {
    pub root: String,
    pub addr: SocketAddr,
    /// Required on every request when set (`Authorization: Bearer`, `?token=` or the cookie).
    pub token: Option<String>,
}

/// A started server: where it listens, and its task.
pub struct Server {
    pub addr: SocketAddr,
    pub task: tokio::task::JoinHandle<()>,
}

/// Binds and starts serving `cfg.root` in the background.
///
/// # Errors
/// [`ViewError::Start`] for a non-loopback address without a token or an address in use;
/// storage errors for a root that cannot be opened.
pub async fn start(cfg: ViewConfig) -> Result<Server, ViewError> {
    if !cfg.addr.ip().is_loopback() && cfg.token.as_deref().is_none_or(str::is_empty) {
        return Err(ViewError::Start(format!(
            "--addr {}: serving another interface than loopback needs --token T (every \
             request must then carry it)",
            cfg.addr
        )));
    }
    let catalog = Arc::new(Catalog::open(&cfg.root).await?);
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .map_err(|e| ViewError::Start(format!("--addr {}: {e}", cfg.addr)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ViewError::Start(e.to_string()))?;
    let app = router(catalog, cfg.token.clone());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(Server { addr, task })
}

fn router(catalog: Arc<Catalog>, token: Option<String>) -> Router {
    let api = Router::new()
        .route("/api/info", get(info))
        .route("/api/runs", get(runs))
        .route("/api/runs/{run}", get(run))
        .route("/api/runs/{run}/results", get(results))
        .route("/api/runs/{run}/scorers", get(scorers))
        .route("/api/runs/{run}/answers", get(answers_page))
        .route("/api/runs/{run}/answers/{call_id}", get(answer))
        .route("/api/runs/{run}/scorer-diff", get(scorer_diff))
        .route("/api/runs/{run}/sql", post(sql))
        .route("/api/runs/{run}/sql.parquet", post(sql_parquet))
        .route("/api/compare", get(compare))
        .route("/api/{*rest}", get(api_unknown).post(api_unknown))
        .with_state(catalog);
    api.route("/assets/app.js", get(app_js))
        .route("/assets/app.css", get(app_css))
        .fallback(get(index))
        .layer(axum::middleware::from_fn(move |req, next| {
            auth(token.clone(), req, next)
        }))
}

/// Checks the token (when one is set) and refuses every method that could write.
async fn auth(token: Option<String>, req: Request, next: Next) -> Response {
    let Some(token) = token else {
        return next.run(req).await;
    };
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let cookie = h
        .get(header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|c| {
            c.split(';')
                .filter_map(|kv| kv.trim().split_once('='))
                .find(|(k, _)| *k == "evalflow_token")
                .map(|(_, v)| v.to_string())
        });
    let query = req.uri().query().and_then(|q| {
        url::form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "token")
            .map(|(_, v)| v.into_owned())
    });
    let ok = |t: &Option<String>| t.as_deref() == Some(token.as_str());
    if !(ok(&bearer) || ok(&cookie) || ok(&query)) {
        return ViewError::Unauthorized(
            "this viewer needs its token: open the URL with ?token=T or send Authorization: \
             Bearer T"
                .into(),
        )
        .into_response();
    }
    let set_cookie = ok(&query) && !ok(&cookie);
    let mut resp = next.run(req).await;
    if set_cookie
        && let Ok(v) = HeaderValue::from_str(&format!(
            "evalflow_token={token}; HttpOnly; SameSite=Strict; Path=/"
        ))
    {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// The page's headers: nothing from another origin may load (the page works offline).
fn page_headers(kind: &'static str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; \
             connect-src 'self'",
        ),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h
}

async fn index() -> impl IntoResponse {
    (page_headers("text/html; charset=utf-8"), INDEX_HTML)
}

async fn app_js() -> impl IntoResponse {
    (page_headers("text/javascript; charset=utf-8"), APP_JS)
}

async fn app_css() -> impl IntoResponse {
    (page_headers("text/css; charset=utf-8"), APP_CSS)
}

/// A query string's pairs, decoded.
fn pairs(q: Option<String>) -> Vec<(String, String)> {
    url::form_urlencoded::parse(q.unwrap_or_default().as_bytes())
        .into_owned()
        .collect()
}

async fn api_unknown(Path(rest): Path<String>) -> ViewError {
    ViewError::NotFound(format!("/api/{rest}: no such endpoint (docs/view.md)"))
}

async fn info(State(c): State<Arc<Catalog>>) -> ApiResult {
    Ok(axum::Json(
        json!({"root": c.root_display(), "version": env!("CARGO_PKG_VERSION")}),
    ))
}

async fn runs(State(c): State<Arc<Catalog>>) -> ApiResult {
    Ok(axum::Json(Value::Array(c.list().await)))
}

async fn run(State(c): State<Arc<Catalog>>, Path(run): Path<String>) -> ApiResult {
    let detail = c.detail(&run).await?;
    // The run page links to its scorer diffs: computed ahead, in turn with other such work.
    let (r, turn) = (c.run(&run).await?, c.background.clone());
    tokio::spawn(async move {
        let _turn = turn.acquire_owned().await;
        diff::warm(&r).await;
    });
    Ok(axum::Json(detail))
}

async fn results(State(c): State<Arc<Catalog>>, Path(run): Path<String>) -> ApiResult {
    let r = c.run(&run).await?;
    Ok(axum::Json(r.results_json().await?))
}

async fn scorers(State(c): State<Arc<Catalog>>, Path(run): Path<String>) -> ApiResult {
    let r = c.run(&run).await?;
    Ok(axum::Json(r.scorers_json().await?))
}

async fn answers_page(
    State(c): State<Arc<Catalog>>,
    Path(run): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let r = c.run(&run).await?;
    let filter = answers::Filter::parse(&pairs(q))?;
    Ok(axum::Json(answers::page(&r, &filter).await?))
}

async fn answer(
    State(c): State<Arc<Catalog>>,
    Path((run, call_id)): Path<(String, String)>,
) -> ApiResult {
    let r = c.run(&run).await?;
    Ok(axum::Json(answers::one(&r, &call_id).await?))
}

async fn scorer_diff(
    State(c): State<Arc<Catalog>>,
    Path(run): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let r = c.run(&run).await?;
    Ok(axum::Json(diff::scorer_diff(&r, &pairs(q)).await?))
}

async fn compare(State(c): State<Arc<Catalog>>, RawQuery(q): RawQuery) -> ApiResult {
    let q = pairs(q);
    let get = |k: &str| {
        q.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| ViewError::BadRequest(format!("compare needs ?{k}=RUN_ID")))
    };
    let (a, b) = (c.run(&get("a")?).await?, c.run(&get("b")?).await?);
    Ok(axum::Json(answers::compare(&a, &b).await?))
}

async fn sql(
    State(c): State<Arc<Catalog>>,
    Path(run): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult {
    let r = c.run(&run).await?;
    Ok(axum::Json(sql_box::run(&r, &sql_text(&body)?).await?))
}

/// The SQL box's query as a Parquet download (`X-Evalflow-Truncated: true` when the
/// download's row cap cut it).
async fn sql_parquet(
    State(c): State<Arc<Catalog>>,
    Path(run): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ViewError> {
    let r = c.run(&run).await?;
    let (bytes, truncated) = sql_box::parquet(&r, &sql_text(&body)?).await?;
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/vnd.apache.parquet"),
    );
    h.insert(
        header::CONTENT_DISPOSITION,
        HeaderValue::from_static("attachment; filename=\"query.parquet\""),
    );
    h.insert(
        "x-evalflow-truncated",
        HeaderValue::from_static(if truncated { "true" } else { "false" }),
    );
    Ok((h, bytes).into_response())
}

/// The `sql` of a `{"sql": "..."}` body.
fn sql_text(body: &[u8]) -> Result<String, ViewError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ViewError::BadRequest(format!("the body must be {{\"sql\": \"...\"}}: {e}"))
    })?;
    v.get("sql")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| ViewError::BadRequest("the body must be {\"sql\": \"...\"}".into()))
}
