//! The two interfaces the collectives are written over ([`backend`]:
//! `Quantizer`, `ByteMover`) and their three backends: the host ([`host`]),
//! the emulated device ([`emulated`]) and the GPU ([`device`]); the device
//! job written once over any of them ([`device_job`]) and its asynchronous
//! calls ([`work`]).

pub mod backend;
pub mod device;
pub mod device_job;
pub mod emulated;
pub mod host;
pub mod work;
