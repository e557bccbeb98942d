//! evalflow: a columnar engine for evaluating LLM applications.
pub mod udaf;
