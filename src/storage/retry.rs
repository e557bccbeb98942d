//! How an object-store root rides out a flaky store: bounded retries with backoff, and a count
//! of the faults retried.
//!
//! object_store retries a request that failed transiently (a 5xx such as S3's 503 SlowDown, a
//! 429, a reset connection, a timeout) with exponential backoff; the bounds are the user's:
//! `EVALFLOW_STORE_RETRIES` (tries after the first, default 10) and
//! `EVALFLOW_STORE_RETRY_SECS` (the longest a request keeps retrying, default 180). Every
//! request goes through [`CountingConnector`], which counts the answers and errors that a
//! retry follows, so a command can say how flaky its store was ([`faults`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::{BackoffConfig, ClientOptions, RetryConfig};

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
