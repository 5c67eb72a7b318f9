//! The simulated machine's shape and the `TMS_SIM_*` environment variables.

use super::faults::{parse_faults, FaultPlan};
use super::SimDriver;
use crate::error::{Error, Result};
use crate::os::page_size;
use crate::units::{env_parsed, parse_bytes};

/// Shape of the simulated machine.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of devices.
    pub devices: i32,
    /// Capacity of each device in bytes.
    pub capacity: u64,
    /// Allocation granularity in bytes (a multiple of the page size).
    pub granularity: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: 8 << 30,
            granularity: 2 << 20,
        }
    }
}

impl SimConfig {
    /// Read `TMS_SIM_DEVICES`, `TMS_SIM_CAPACITY` and `TMS_SIM_GRANULARITY`.
    pub fn from_env() -> Result<Self> {
        let mut c = SimConfig::default();
        if let Some(n) = env_parsed("TMS_SIM_DEVICES", |s| {
            s.trim()
                .parse::<i32>()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| {
                    Error::invalid_argument(format!("{s:?} is not a device count from 1 to 64"))
                })
        })? {
            c.devices = n;
        }
        if let Some(b) = env_parsed("TMS_SIM_CAPACITY", parse_bytes)? {
            c.capacity = b;
        }
        if let Some(g) = env_parsed("TMS_SIM_GRANULARITY", parse_bytes)? {
            c.granularity = g;
        }
        // Only the granularity is checked, and its default passes: a failure is the variable's.
        c.validate()
            .map_err(|e| e.context("environment variable TMS_SIM_GRANULARITY"))?;
        Ok(c)
    }

    pub(super) fn validate(&self) -> Result<()> {
        let page = page_size();
        if self.granularity == 0
            || !self.granularity.is_multiple_of(page)
            || !self.granularity.is_power_of_two()
        {
            return Err(Error::invalid_argument(format!(
                "sim granularity {} must be a power of two and a multiple of the page size {page}",
                self.granularity
            )));
        }
        Ok(())
    }
}

/// The `TMS_SIM_*` environment variables, read.
#[derive(Clone, Debug)]
pub struct SimEnv {
    /// The machine's shape.
    pub config: SimConfig,
    /// Faults to arm (`TMS_SIM_FAULTS`).
    pub faults: FaultPlan,
    /// Host memory to pretend is available (`TMS_SIM_HOST_MEMORY`).
    pub host_memory: Option<u64>,
    /// Delay of every device synchronization (`TMS_SIM_SYNC_DELAY_MS`).
    pub sync_delay: Option<std::time::Duration>,
    /// Bytes per second of the host-device link (`TMS_SIM_BANDWIDTH`).
    pub bandwidth: Option<u64>,
}

impl SimDriver {
    /// From `TMS_SIM_*` environment variables, faults from `TMS_SIM_FAULTS` armed.
    pub fn from_env() -> Result<Self> {
        let env = Self::settings_from_env()?;
        let d = SimDriver::new(env.config)?;
        for (p, n, c) in env.faults {
            d.arm_fault(p, n, c);
        }
        d.set_host_memory(env.host_memory);
        d.set_sync_delay(env.sync_delay);
        d.set_bandwidth(env.bandwidth);
        Ok(d)
    }

    /// The `TMS_SIM_*` settings, each malformed value an error naming its variable.
    pub fn settings_from_env() -> Result<SimEnv> {
        Ok(SimEnv {
            config: SimConfig::from_env()?,
            faults: env_parsed("TMS_SIM_FAULTS", parse_faults)?.unwrap_or_default(),
            host_memory: env_parsed("TMS_SIM_HOST_MEMORY", parse_bytes)?,
            sync_delay: env_parsed("TMS_SIM_SYNC_DELAY_MS", |v| {
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|ms| *ms <= 3_600_000)
                    .map(std::time::Duration::from_millis)
                    .ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "{v:?} is not a number of milliseconds from 0 to 3600000"
                        ))
                    })
            })?,
            bandwidth: env_parsed("TMS_SIM_BANDWIDTH", |v| match parse_bytes(v)? {
                0 => Err(Error::invalid_argument(format!(
                    "{v:?}: the link's bytes per second must be above 0"
                ))),
                b => Ok(b),
            })?,
        })
    }

    /// The machine's shape.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }
}
