//! The expert cache, prefetch queue, memory planner and budget resolver, usage hotlist.
#![deny(missing_docs)]
