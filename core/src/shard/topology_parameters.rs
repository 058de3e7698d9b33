//! Runtime parameters (RabbitMQ's `set_parameter`): kept per vhost by topology, stored like
//! policies; their values are the host's to validate and act on (see `crate::parameter`).

use super::Broker;
use crate::admin::AdminError;
use crate::parameter::{MAX_PER_VHOST, MAX_VALUE_BYTES, ParameterDef};
use crate::store::DefinitionChange;

impl Broker {
    /// Adds or replaces a parameter in its vhost; the error says why it is refused.
    pub fn set_parameter(&mut self, now: u64, def: ParameterDef) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let vh = self
            .vhost_id(&def.vhost)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{}' does not exist", def.vhost)))?;
        if def.value.len() > MAX_VALUE_BYTES {
            return Err(AdminError::Invalid(format!(
                "parameter value is {} bytes, over the limit of {MAX_VALUE_BYTES}",
                def.value.len()
            )));
        }
        let key = (def.component.clone(), def.name.clone());
        let Some(params) = self.topo.parameters_mut(vh) else {
            return Err(AdminError::NotFound(format!(
                "vhost '{}' does not exist",
                def.vhost
            )));
        };
        if params.len() >= MAX_PER_VHOST && !params.contains_key(&key) {
            return Err(AdminError::Invalid(format!(
                "vhost '{}' already has {MAX_PER_VHOST} parameters",
                def.vhost
            )));
        }
        params.insert(key, def.clone());
        self.define(DefinitionChange::ParameterSet(&def));
        Ok(())
    }

    /// Removes a parameter; the error names a missing one (RabbitMQ's text).
    pub fn clear_parameter(
        &mut self,
        now: u64,
        vhost: &str,
        component: &str,
        name: &str,
    ) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let key = (component.to_string(), name.to_string());
        let removed = self
            .vhost_id(vhost)
            .and_then(|vh| self.topo.parameters_mut(vh))
            .and_then(|p| p.remove(&key))
            .is_some();
        if !removed {
            return Err(AdminError::NotFound("Parameter does not exist".into()));
        }
        self.define(DefinitionChange::ParameterCleared {
            vhost,
            component,
            name,
        });
        Ok(())
    }

    /// Every parameter, by vhost, component and name.
    pub fn list_parameters(&self) -> Vec<ParameterDef> {
        self.topo.list_parameters()
    }
}
