//! Run roots: a path, `memory://NAME`, or an object store URL (`s3://`, `gs://`, `az://`),
//! parsed into the store and the prefix under it.

use std::sync::Arc;

// ParquetObjectReader is deprecated in parquet 59 in favour of a hand-written
// AsyncFileReader; it is still the simplest correct reader over object_store.
use object_store::ObjectStore;
use object_store::memory::InMemory;
use url::Url;

use super::StorageError;

/// A run root (or table) URL, parsed once: which object store it needs and where in it.
///
/// # Behavior
/// A path without a scheme (or `file://`) is local; `memory://NAME/...` is a process-wide
/// in-memory store; `s3://` / `s3a://`, `gs://` and `az://` / `azure://` name a bucket
/// (container) and a prefix. `gs://` and `az://` need the `gcp` / `azure` cargo features;
/// without them the root is refused with a message naming the feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootUrl {
    Local(String),
    Memory { name: String, prefix: String },
    S3 { bucket: String, prefix: String },
    Gcs { bucket: String, prefix: String },
    Azure { container: String, prefix: String },
}

impl RootUrl {
    /// Parses a root or table location.
    ///
    /// # Errors
    /// [`StorageError::BadRoot`] for an unparseable URL, an unknown scheme or a missing
    /// bucket.
    pub fn parse(root: &str) -> Result<RootUrl, StorageError> {
        let bad = |msg: String| StorageError::BadRoot {
            root: root.to_string(),
            msg,
        };
        if !root.contains("://") || root.starts_with("file://") {
            return Ok(RootUrl::Local(
                root.strip_prefix("file://").unwrap_or(root).to_string(),
            ));
        }
        let url = Url::parse(root).map_err(|e| bad(e.to_string()))?;
        let host = url.host_str().unwrap_or("").to_string();
        let prefix = url.path().trim_matches('/').to_string();
        let scheme = url.scheme();
        if host.is_empty() && scheme != "memory" {
            return Err(bad(format!("no bucket in the `{scheme}://` URL")));
        }
        Ok(match scheme {
            "memory" => RootUrl::Memory { name: host, prefix },
            "s3" | "s3a" => RootUrl::S3 {
                bucket: host,
                prefix,
            },
            "gs" => RootUrl::Gcs {
                bucket: host,
                prefix,
            },
            "az" | "azure" => RootUrl::Azure {
                container: host,
                prefix,
            },
            other => {
                return Err(bad(format!(
                    "unsupported scheme `{other}://` (a local path, memory://, s3://, gs:// or az://)"
                )));
            }
        })
    }

    /// The cargo feature this kind of root needs, if any (`gcp`, `azure`).
    pub fn feature(&self) -> Option<&'static str> {
        match self {
            RootUrl::Gcs { .. } => Some("gcp"),
            RootUrl::Azure { .. } => Some("azure"),
            _ => None,
        }
    }

    /// The object store for a non-local root, configured from the environment.
    pub(super) fn object_store(&self, root: &str) -> Result<Arc<dyn ObjectStore>, String> {
        match self {
            RootUrl::Local(_) => Ok(Arc::new(object_store::local::LocalFileSystem::new())),
            RootUrl::Memory { name, .. } => Ok(memory_store(name)),
            RootUrl::S3 { .. } => s3_store(root),
            RootUrl::Gcs { .. } => gcs_store(root),
            RootUrl::Azure { .. } => azure_store(root),
        }
    }
}

/// The message for a root whose object store was not built in.
#[cfg(not(all(feature = "gcp", feature = "azure")))]
fn feature_off(scheme: &str, feature: &str) -> String {
    format!(
        "{scheme} roots need evalflow built with the `{feature}` cargo feature \
         (cargo build --features {feature}); this binary was built without it"
    )
}

/// An S3 store from the `AWS_*` environment. Credentials must be given (or signing
/// skipped): with none, object_store's default chain probes the instance-metadata address
/// and stalls on a machine that has none, so that is refused up front.
fn s3_store(root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    let skip = std::env::var("AWS_SKIP_SIGNATURE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let has_credentials = (set("AWS_ACCESS_KEY_ID") && set("AWS_SECRET_ACCESS_KEY"))
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        || set("AWS_METADATA_ENDPOINT");
    if !has_credentials && !skip {
        return Err(
            "no S3 credentials in the environment: set AWS_ACCESS_KEY_ID and \
                    AWS_SECRET_ACCESS_KEY (or AWS_SKIP_SIGNATURE=true for a public bucket, or \
                    AWS_METADATA_ENDPOINT to use instance credentials)"
                .into(),
        );
    }
    object_store::aws::AmazonS3Builder::from_env()
        .with_url(root)
        .with_retry(super::retry::retry_config())
        .with_http_connector(super::retry::CountingConnector)
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| e.to_string())
}

#[cfg(feature = "gcp")]
fn gcs_store(root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_url(root)
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "gcp"))]
fn gcs_store(_root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    Err(feature_off("gs://", "gcp"))
}

#[cfg(feature = "azure")]
fn azure_store(root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_url(root)
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "azure"))]
fn azure_store(_root: &str) -> Result<Arc<dyn ObjectStore>, String> {
    Err(feature_off("az://", "azure"))
}

/// Process-wide in-memory stores, so every stage of one process sees the same `memory://NAME`.
fn memory_store(name: &str) -> Arc<dyn ObjectStore> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static STORES: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    let mut map = STORES.get_or_init(Default::default).lock().unwrap();
    map.entry(name.to_string())
        .or_insert_with(|| Arc::new(InMemory::new()))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::RunStore;
    #[test]
    fn root_urls_parse_into_store_and_prefix() {
        let p = |s: &str| RootUrl::parse(s).unwrap();
        assert_eq!(p("runs/r1"), RootUrl::Local("runs/r1".into()));
        assert_eq!(p("file:///tmp/r"), RootUrl::Local("/tmp/r".into()));
        assert_eq!(
            p("memory://t/a/b"),
            RootUrl::Memory {
                name: "t".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            p("s3://bucket/runs/r1/"),
            RootUrl::S3 {
                bucket: "bucket".into(),
                prefix: "runs/r1".into()
            }
        );
        assert_eq!(
            p("gs://b/x"),
            RootUrl::Gcs {
                bucket: "b".into(),
                prefix: "x".into()
            }
        );
        assert_eq!(p("gs://b/x").feature(), Some("gcp"));
        assert_eq!(
            p("az://c/x/y"),
            RootUrl::Azure {
                container: "c".into(),
                prefix: "x/y".into()
            }
        );
        assert_eq!(p("azure://c").feature(), Some("azure"));
        assert_eq!(p("s3://b").feature(), None);
        for bad in ["ftp://host/x", "s3:///no-bucket", "gs://"] {
            let e = RootUrl::parse(bad).unwrap_err();
            assert!(matches!(e, StorageError::BadRoot { .. }), "{bad}: {e}");
        }
    }

    #[cfg(not(feature = "gcp"))]
    #[test]
    fn gs_root_without_the_feature_names_it() {
        let e = RunStore::open("gs://bucket/run").unwrap_err();
        assert!(e.is_bad_input());
        let msg = e.to_string();
        assert!(
            msg.contains("gs://bucket/run") && msg.contains("`gcp` cargo feature"),
            "{msg}"
        );
    }

    #[cfg(not(feature = "azure"))]
    #[test]
    fn az_root_without_the_feature_names_it() {
        let e = RunStore::open("az://container/run").unwrap_err();
        assert!(e.is_bad_input());
        assert!(e.to_string().contains("`azure` cargo feature"), "{e}");
    }
}
