//! How an object-store root rides out a flaky store: bounded retries with backoff, and a count
//! of the faults retried.
//!
//! object_store retries a request that failed transiently (a 5xx such as S3's 503 SlowDown, a
//! 429, a reset connection, a timeout) with exponential backoff; the bounds are the user's:
//! `EVALFLOW_STORE_RETRIES` (tries after the first, default 10) and
//! `EVALFLOW_STORE_RETRY_SECS` (the longest a request keeps retrying, default 180). Every
//! request goes through [`CountingConnector`], which counts the answers and errors that a
//! retry follows, so a command can say how flaky its store was ([`faults`]).
//!
//! object_store does not retry every request: a conditional put (a lost answer would come
//! back as a conflict) and S3's deletes (sent as a multi-object `POST ?delete` that it does not
//! mark idempotent) fail at the first dropped connection. [`retrying`], [`delete`] and
//! [`rename`] retry those within the same bounds (the soak found the deletes: two sessions in
//! 21 ended on one at 2% store faults).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};

static FAULTS: AtomicU64 = AtomicU64::new(0);

/// Transient faults (5xx, 429, transport errors) the object stores of this process met.
pub fn faults() -> u64 {
    FAULTS.load(Ordering::Relaxed)
}

/// The retry bounds, from the environment.
pub fn retry_config() -> RetryConfig {
    let retries = crate::config::env_number("EVALFLOW_STORE_RETRIES").map_or(10, |n| n as usize);
    let secs = crate::config::env_number("EVALFLOW_STORE_RETRY_SECS").unwrap_or(180);
    RetryConfig {
        backoff: BackoffConfig::default(),
        max_retries: retries,
        retry_timeout: Duration::from_secs(secs),
    }
}

/// object_store's reqwest client, counting the transient faults it sees.
#[derive(Debug, Default)]
pub struct CountingConnector;

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(Counting(
            ReqwestConnector::default().connect(options)?,
        )))
    }
}

#[derive(Debug)]
struct Counting(HttpClient);

#[async_trait::async_trait]
impl HttpService for Counting {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let r = self.0.execute(req).await;
        let transient = match &r {
            Ok(resp) => resp.status().is_server_error() || resp.status().as_u16() == 429,
            Err(_) => true,
        };
        if transient {
            FAULTS.fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

/// Runs a request again after a transient failure (a 5xx, a dropped connection), within the
/// bounds of [`retry_config`]. An answer that says what is (exists, not found, precondition
/// failed, refused) is returned at once: the caller decides what it means after a retry.
pub async fn retrying<T, F, Fut>(f: F) -> object_store::Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = object_store::Result<T>>,
{
    use object_store::Error as E;
    let cfg = retry_config();
    let started = std::time::Instant::now();
    let mut wait = cfg.backoff.init_backoff;
    let mut tries = 0;
    loop {
        match f().await {
            Err(
                e @ (E::AlreadyExists { .. }
                | E::Precondition { .. }
                | E::NotImplemented { .. }
                | E::NotFound { .. }
                | E::NotModified { .. }
                | E::PermissionDenied { .. }
                | E::Unauthenticated { .. }),
            ) => return Err(e),
            Err(e) if tries < cfg.max_retries && started.elapsed() + wait < cfg.retry_timeout => {
                tracing::info!("object store: retrying after a transient error: {e}");
                tries += 1;
                tokio::time::sleep(wait).await;
                wait = wait.mul_f64(cfg.backoff.base).min(cfg.backoff.max_backoff);
            }
            other => return other,
        }
    }
}

/// Deletes `p`, retried; an object already gone (or deleted by a try whose answer was lost)
/// is no error.
pub async fn delete(os: &dyn ObjectStore, p: &Path) -> object_store::Result<()> {
    match retrying(|| os.delete(p)).await {
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        r => r,
    }
}

/// Renames `from` to `to` (a copy, then a delete, on S3), retried: a try whose delete went
/// through but whose answer was lost leaves `to` in place and `from` gone, which is done.
pub async fn rename(os: &dyn ObjectStore, from: &Path, to: &Path) -> object_store::Result<()> {
    match retrying(|| os.rename(from, to)).await {
        Err(e @ object_store::Error::NotFound { .. }) => match os.head(to).await {
            Ok(_) => Ok(()),
            Err(_) => Err(e),
        },
        r => r,
    }
}
