//! Run storage: a run root on local disk, in memory or in an object store, holding one
//! folder of Parquet parts per table and a `manifest.json`.
//!
//! Every write is atomic: a local part is written under a temporary name and renamed into
//! place ([`PartFile`]), any other is uploaded whole with `put` (S3 and friends commit on
//! completion), so a reader never sees half a part and a crash never corrupts a committed
//! one.

mod bloom;
pub mod compact;
pub mod lease;
mod manifest;
mod part_file;
mod parts;
pub mod point;
pub mod retry;
mod root;
mod store;

pub use bloom::{Bloom, hash as bloom_hash};
pub use lease::Lease;
pub use manifest::{Manifest, StageRecord, StageStatus, now as manifest_now};
pub use part_file::PartFile;
pub use parts::{PartWriter, PipelinedEncoder, encode_parquet, parquet_props};
pub use root::RootUrl;
pub use store::{PART_ROWS, PartFooter, RunStore, part_rows};

/// Errors of the run store. Each names the location it concerns.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// Another process writes this root (it holds `_lease.json`).
    #[error(
        "{root}: another writer holds this root: {holder}; wait for it to finish, or pass \
         --wait-lock to wait"
    )]
    Leased { root: String, holder: String },
    /// The run root could not be understood (bad URL, unsupported scheme).
    #[error("run root `{root}`: {msg}")]
    BadRoot { root: String, msg: String },
    /// The object store failed.
    #[error("{location}: {source}")]
    Store {
        location: String,
        #[source]
        source: object_store::Error,
    },
    /// The object store refused our credentials (or found none it may use).
    #[error(
        "{location}: access denied: {source} (check the credentials in the environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://)"
    )]
    Credentials {
        location: String,
        #[source]
        source: object_store::Error,
    },
    /// A committed part of the run is not readable Parquet (truncated, hand-edited).
    #[error("{location}: {what}: not readable Parquet: {source}")]
    CorruptPart {
        location: String,
        /// Where in the file: `footer`, or `rows from N` while decoding.
        what: String,
        #[source]
        source: datafusion::parquet::errors::ParquetError,
    },
    /// Encoding or decoding Parquet failed.
    #[error("{location}: {source}")]
    Parquet {
        location: String,
        #[source]
        source: datafusion::parquet::errors::ParquetError,
    },
    /// A table read from the run does not have the declared schema.
    #[error(transparent)]
    Schema(#[from] crate::schema::SchemaError),
    /// The manifest is not valid JSON of the expected shape.
    #[error("{location}: {msg}")]
    Manifest { location: String, msg: String },
    /// Writing a part's local file or renaming it into place failed.
    #[error("{location}: {source}")]
    Io {
        location: String,
        #[source]
        source: std::io::Error,
    },
    /// The task encoding and writing a part panicked or was cancelled.
    #[error("{location}: the task writing this part stopped: {msg}")]
    Task { location: String, msg: String },
    /// A stage needs a table that the run does not have yet.
    #[error("{root}: table `{table}` has no parts; run `evalflow {stage}` first")]
    MissingTable {
        root: String,
        table: String,
        stage: String,
    },
}

impl StorageError {
    /// Whether the user can fix this by changing their input or environment (exit code 2):
    /// a bad root URL, missing credentials, a corrupt manifest or part, a table that does
    /// not fit its schema. Everything else is an I/O or internal failure.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            StorageError::BadRoot { .. }
                | StorageError::Leased { .. }
                | StorageError::Credentials { .. }
                | StorageError::CorruptPart { .. }
                | StorageError::Schema(_)
                | StorageError::Manifest { .. }
                | StorageError::MissingTable { .. }
        )
    }
}
