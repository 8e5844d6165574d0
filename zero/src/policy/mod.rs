//! The decisions: the routing plan from every node's detected topology
//! ([`routing`]), the switches and the wire formats they become ([`plan`]),
//! the links measured at join ([`probe`]), the cost model ([`cost`]) and
//! what it is fed from a run ([`planner`]), and a joined job built by one
//! rule for every caller ([`job`]).

pub mod cost;
pub mod job;
pub mod plan;
pub mod planner;
pub mod probe;
pub mod routing;
