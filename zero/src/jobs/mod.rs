//! The jobs above the collectives: the device half of a joined job, written
//! once for every device ([`device_job`]: FSDP2's calls on the caller's
//! pointers and stream, launched asynchronously, and what a failure does).

pub mod device_job;
