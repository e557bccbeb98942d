//! evalflow: a columnar engine for evaluating LLM applications.
//!
//! Five stages (generate, call, validate, score, aggregate) read and write Arrow record
//! batches stored as Parquet under a run root; the statistics are DataFusion functions
//! so every table can be queried with SQL. See DESIGN.md for the contract.

pub mod cli;
#[cfg(feature = "ballista")]
pub mod cluster;
pub mod config;
pub mod import;
pub mod judge;
pub mod mock;
pub mod pipeline;
pub mod progress;
pub mod query;
pub mod report;
pub mod runner;
pub mod schema;
pub mod stages;
pub mod storage;
pub mod udaf;
pub mod vader;
pub mod validity;
pub mod verify;
pub mod view;

pub use udaf::register_all;
