//! The five stages: generate, call, validate, score, aggregate. One module each; each
//! reads tables from the run store and writes one table.

pub mod aggregate;
pub mod call;
pub mod generate;
pub mod score;
pub mod validate;
