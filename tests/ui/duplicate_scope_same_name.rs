use idempotent_runtime::{idempotent, Error};

// Two methods of one name, on two types, in one file: two claimants.
pub struct Cards;
pub struct Wallets;

impl Cards {
    #[idempotent(scope = "payments.charge", key = key, tenant = shared)]
    pub async fn charge(&self, key: &str) -> Result<u8, Error> {
        Ok(1)
    }
}

impl Wallets {
    #[idempotent(scope = "payments.charge", key = key, tenant = shared)]
    pub async fn charge(&self, key: &str) -> Result<u8, Error> {
        Ok(2)
    }
}

// One function stamped into two modules by a macro: one site, two claimants.
macro_rules! refund_in {
    ($module:ident) => {
        mod $module {
            use super::*;

            #[idempotent(scope = "payments.refund", key = key, tenant = shared)]
            pub async fn refund(key: &str) -> Result<u8, Error> {
                Ok(3)
            }
        }
    };
}

refund_in!(cards);
refund_in!(wallets);

fn main() {}
