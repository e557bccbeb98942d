//! Statistics as DataFusion functions (see DESIGN.md, "SQL surface").
//!
//! One function per file; `register_all` is the single registry used by `evalflow sql`
//! and by library users.

use datafusion::prelude::SessionContext;

/// Registers every evalflow statistics function on `ctx`.
pub fn register_all(_ctx: &SessionContext) {}
